"""The whole pipeline for one kernel: spec -> IR -> object code (cached) -> function address.

    mod = emit(spec, target); obj = cache or compile_object(str(mod)); addr = load_symbols(obj)

A process compiles or loads each spec once; concurrent first calls of the same spec wait for the
one compilation.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from . import cache, tile_permission
from .compiler import compile_assembly, compile_object
from .loader import load_symbols
from .target import Target, host_has_amx, host_target

log = logging.getLogger("kwker")

# family -> module exposing ``emit(spec, target) -> ir.Module``
EMITTERS = {
    "sorting": "kwker.codegen.sorting",
    "eltwise": "kwker.codegen.elementwise",
    "gemm": "kwker.codegen.gemm",
    "attention": "kwker.codegen.attention",
    "topk_gemm": "kwker.codegen.fused_topk",
    "layernorm": "kwker.codegen.layernorm",
    "rope": "kwker.codegen.rope",
    "row_copy": "kwker.codegen.row_copy",
    "int4_pack": "kwker.codegen.int4_pack",
    "chain": "kwker.codegen.chain",
    "gemm_lowbit": "kwker.codegen.gemm_lowbit",
    "lowbit_planes": "kwker.codegen.gemm_lowbit_planes",
    "lowbit_panels": "kwker.codegen.gemm_lowbit_planes",
}

stats = {"hits": 0, "misses": 0, "compile_seconds": 0.0, "packaged": 0}
_policy = threading.local()


class NotCompiled(Exception):
    """Raised inside ``compiling(False)`` for a kernel that would need an LLVM compile."""


@contextlib.contextmanager
def compiling(allowed: bool):
    """Within ``compiling(False)``, kernels come from this process or the disk cache only:
    the lowering asks for a size-specialised kernel this way and takes the generic one when it
    is not there, so a new size never waits for a compile."""
    outer = getattr(_policy, "allowed", True)
    _policy.allowed = allowed
    try:
        yield
    finally:
        _policy.allowed = outer


_provided: dict[str, bytes] = {}


def provide(objects: dict[str, bytes]) -> None:
    """Object code by cache key, from a package whose integrity was checked: taken before the
    disk cache, so a package for this CPU loads without compiling or writing anything."""
    _provided.update(objects)


_kernels: dict = {}
_locks: dict = {}
_registry_lock = threading.Lock()


def emit(spec, target: Target):
    return importlib.import_module(EMITTERS[spec.family]).emit(spec, target)


_gc_pause = {"depth": 0, "restore": False}
_gc_lock = threading.Lock()


@contextlib.contextmanager
def gc_paused():
    """The cyclic garbage collector off while llvmlite builds and prints a module: its hundreds
    of thousands of short-lived objects set off collections that each walk the whole heap (torch,
    dynamo), which made emitting a GEMM kernel 2-3x slower (eight linears' kernels on Zen 5:
    2.2-3.1 s -> 1.0 s). Nothing a build makes is cyclic garbage that must go sooner. Nested and
    concurrent builds share one pause; the collector is restored when the last one ends."""
    with _gc_lock:
        if _gc_pause["depth"] == 0:
            _gc_pause["restore"] = gc.isenabled()
            gc.disable()
        _gc_pause["depth"] += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pause["depth"] -= 1
            if _gc_pause["depth"] == 0 and _gc_pause["restore"]:
                gc.enable()


def ir_text(spec, target: Target) -> str:
    """``spec``'s module as LLVM IR text."""
    with gc_paused():
        return str(emit(spec, target))


def build_object(spec, target: Target) -> bytes:
    """Emit and compile without touching the cache (prewarming, tests)."""
    text = ir_text(spec, target)
    dump_dir = os.environ.get("KWKER_DUMP_DIR")
    if dump_dir:
        dump(spec, target, text, Path(dump_dir))
    return compile_object(text, target)


def dump(spec, target: Target, ir_text: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    opt_ir, asm = compile_assembly(ir_text, target)
    (folder / f"{spec.symbol}.ll").write_text(ir_text)
    (folder / f"{spec.symbol}.opt.ll").write_text(opt_ir)
    (folder / f"{spec.symbol}.s").write_text(asm)


def expected_header(spec, target: Target, key: str) -> dict:
    return {"key": key, "spec": spec.to_json(), "symbol": spec.symbol,
            "target": asdict(target), **cache.versions()}


def object_for(spec, target: Target) -> bytes:
    """Object code for ``spec`` from the disk cache, compiling (and storing) on a miss."""
    key = cache.entry_key(spec.id, target)
    obj = _provided.get(key)
    if obj is not None:
        stats["packaged"] += 1
        return obj
    header = expected_header(spec, target, key)
    expect = {k: header[k] for k in ("key", "symbol", "target", "kwker", "llvm")}
    timing = {}

    def build() -> bytes:
        if not getattr(_policy, "allowed", True):
            raise NotCompiled(spec.symbol)
        t0 = time.perf_counter()
        obj = build_object(spec, target)
        timing["dt"] = time.perf_counter() - t0
        return obj

    obj, hit = cache.get_or_build(key, expect, header, build)
    if hit:
        stats["hits"] += 1
        if os.environ.get("KWKER_DEBUG"):
            log.info("kwker: cache hit %s", spec.symbol)
        return obj
    stats["misses"] += 1
    stats["compile_seconds"] += timing["dt"]
    if os.environ.get("KWKER_DEBUG"):
        log.info("kwker: compiled %s in %.3f s", spec.symbol, timing["dt"])
    return obj


def get_kernel(spec) -> int:
    """Address of ``spec``'s exported function, built or loaded once per process."""
    addr = _kernels.get(spec)
    if addr is not None:
        return addr
    with _registry_lock:
        lock = _locks.setdefault(spec, threading.Lock())
    with lock:
        addr = _kernels.get(spec)
        if addr is None:
            target = host_target()
            if target.tiles == "amx" and host_has_amx() and not tile_permission.granted():
                # a KWKER_CPU naming an AMX CPU on an AMX host that refused the tile state: its
                # tile kernels would die of SIGILL here. A host without AMX cannot run that
                # target's code at all (like AVX-512 code on an AVX2 host): it is loaded only to
                # be compiled and packaged (packaging._specs_for), never called
                raise RuntimeError(f"kwker: {spec.symbol} is built for AMX tiles, which this "
                                   f"process may not use: {tile_permission.refusal()}. Set "
                                   "KWKER_TILES=off (or emulate) to build without them")
            obj = object_for(spec, target)
            addr = load_symbols(obj, [spec.symbol])[spec.symbol]
            _kernels[spec] = addr
    return addr
