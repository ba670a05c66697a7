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


def stream_probe():
    """``sym(buf, words, sink, nthreads)``: every thread XORs its contiguous share of ``words``
    int32 (whole 64-byte lines, 4 independent chains): the bandwidth a streaming read of a
    weight-sized buffer reaches, the roofline of weight-streaming (decode) kernels."""
    from kwker.codegen.irutil import i64
    target = host_target()
    lanes = 16 if target.vector_bits >= 512 else 8
    vt = ir.VectorType(i32, lanes)
    module = ir.Module("stream")
    body = omp.body_fn(module, "stream.body")
    b = body.b
    ctx = omp.Context(body, body.args[0])
    buf, words, sink = ctx.ptr(0), ctx.i64(1), ctx.ptr(2)
    unroll = 4
    step = lanes * unroll
    begin, end = omp.split(body, b.udiv(words, ir.Constant(i64, step)), body.args[1],
                           body.args[2])
    accs = [body.var(vt, ir.Constant(vt, [0] * lanes)) for _ in range(unroll)]
    with body.for_range(begin, end) as i:
        base = b.mul(i, ir.Constant(i64, step))
        for u, a in enumerate(accs):
            p = b.gep(buf, [b.add(base, ir.Constant(i64, u * lanes))], source_etype=i32)
            a.set(b.xor(a.get(), b.load(p, typ=vt, align=64)))
    total = accs[0].get()
    for a in accs[1:]:
        total = b.xor(total, a.get())
    b.store(b.extract_element(total, ir.Constant(i32, 0)),
            b.gep(sink, [body.args[1]], source_etype=i32))
    body.finish()
    omp.emit_parallel(module, "kw_stream_probe", [ptr, i64, ptr], body.fn)
    addr = load_symbols(compile_object(str(module), target), ["kw_stream_probe"])
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_int64)(addr["kw_stream_probe"])


def stream_gbps(nbytes: int, threads: int, reps: int = 20) -> float:
    """Best GB/s of a streaming read of ``nbytes`` (a fresh buffer, read ``reps`` times)."""
    import time

    import torch
    probe = stream_probe()
    buf = torch.ones(max(64, nbytes) // 4, dtype=torch.int32)
    sink = torch.zeros(64, dtype=torch.int32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        probe(buf.data_ptr(), buf.numel(), sink.data_ptr(), threads)
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9
