"""LLVM IR text -> optimised object code, with the new pass manager.

llvmlite 0.50 has no legacy pass manager; ``emit_object`` on an unoptimised module does not
vectorise, so every module runs through the O3 module pipeline with loop and SLP vectorisation
switched on before code generation.
"""
from __future__ import annotations

import functools
import threading

import llvmlite.binding as llvm

from .target import Target

_lock = threading.Lock()  # LLVM's global context is not safe to use from two threads at once


@functools.lru_cache(maxsize=None)
def target_machine(target: Target) -> llvm.TargetMachine:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    tgt = llvm.Target.from_triple(target.triple)
    return tgt.create_target_machine(cpu=target.cpu, features=target.features,
                                     opt=target.compile_level, reloc="static",
                                     codemodel="jitdefault")


def _optimise(module: llvm.ModuleRef, target: Target) -> None:
    tm = target_machine(target)
    pto = llvm.create_pipeline_tuning_options(speed_level=target.compile_level)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    pb.getModulePassManager().run(module, pb)


def parse_and_optimise(ir_text: str, target: Target) -> llvm.ModuleRef:
    module = llvm.parse_assembly(ir_text)
    module.verify()
    tm = target_machine(target)
    module.triple = target.triple
    module.data_layout = str(tm.target_data)
    _optimise(module, target)
    return module


def compile_object(ir_text: str, target: Target) -> bytes:
    """Optimise ``ir_text`` for ``target`` and return ELF object bytes."""
    with _lock:
        module = parse_and_optimise(ir_text, target)
        return target_machine(target).emit_object(module)


def compile_assembly(ir_text: str, target: Target) -> tuple[str, str]:
    """(optimised IR, assembly) for dumps and codegen tests; works for any target."""
    with _lock:
        module = parse_and_optimise(ir_text, target)
        return str(module), target_machine(target).emit_assembly(module)
