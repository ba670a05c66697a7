"""JIT'd peak probes: independent accumulator chains, the most a core can do of one instruction."""
from __future__ import annotations

import ctypes

from llvmlite import ir

from kwker.codegen import omp, vmath
from kwker.codegen.irutil import f32, i32, ptr
from kwker.runtime.compiler import compile_object
from kwker.runtime.loader import load_symbols
from kwker.runtime.target import host_target

CHAINS = 12


def chain_probe(name: str, acc_type: ir.VectorType, step, iters: int, chains: int = CHAINS):
    """``sym(sink, nthreads)`` running ``chains`` independent chains ``acc = step(b, acc)`` of
    ``iters`` steps on every thread (their sum is stored, so nothing is optimised away)."""
    target = host_target()
    module = ir.Module(name)
    body = omp.body_fn(module, f"{name}.body")
    b = body.b
    accs = [body.var(acc_type, vmath.splat(acc_type, 0.0)) for _ in range(chains)]
    with body.for_range(0, iters):
        for a in accs:
            a.set(step(b, a.get()))
    total = accs[0].get()
    for a in accs[1:]:
        total = b.fadd(total, a.get())
    out = omp.Context(body, body.args[0]).ptr(0)
    b.store(b.extract_element(total, ir.Constant(i32, 0)),
            b.gep(out, [body.args[1]], source_etype=f32))
    body.finish()
    symbol = f"kw_{name}_probe_{iters}"
    omp.emit_parallel(module, symbol, [ptr], body.fn)
    addr = load_symbols(compile_object(str(module), target), [symbol])[symbol]
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(addr)
