"""JIT'd probes: peaks (independent accumulator chains, the most a core can do of one
instruction) and the bandwidth of a streaming read."""
from __future__ import annotations

import ctypes
import time

import torch
from llvmlite import ir

from kwker.codegen import omp, simd, vmath
from kwker.codegen.irutil import f32, i32, i64, ptr
from kwker.runtime import huge_pages
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


def best(call, samples: int, min_seconds: float = 0.5) -> float:
    """Least seconds of ``call`` over at least ``samples`` calls and ``min_seconds``."""
    call()
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < samples or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def read_probe(lanes: int):
    """A JIT'd kernel ``read(buf, n, passes, out, nthreads)``: each thread sums its contiguous
    share of ``n`` floats ``passes`` times with 8 independent vector accumulators."""
    module = ir.Module("l3read")
    body = omp.body_fn(module, "l3read.body")
    b = body.b
    ctx = omp.Context(body, body.args[0])
    buf, n, passes, out = ctx.ptr(0), ctx.i64(1), ctx.i64(2), ctx.ptr(3)
    begin, end = omp.split(body, b.udiv(n, ir.Constant(i64, 8 * lanes)), body.args[1],
                           body.args[2])
    vt = ir.VectorType(f32, lanes)
    accs = [body.var(vt, vmath.splat(vt, 0.0)) for _ in range(8)]
    with body.for_range(0, passes):
        with body.for_range(begin, end, name="blk") as blk:
            base = b.mul(blk, ir.Constant(i64, 8 * lanes))
            for j, a in enumerate(accs):
                v = simd.load_vec(b, buf, b.add(base, ir.Constant(i64, j * lanes)), lanes)
                a.set(b.fadd(a.get(), v))
    total = accs[0].get()
    for a in accs[1:]:
        total = b.fadd(total, a.get())
    b.store(b.extract_element(total, ir.Constant(i32, 0)),
            b.gep(out, [body.args[1]], source_etype=f32))
    body.finish()
    symbol = f"kw_l3_read_{lanes}"
    omp.emit_parallel(module, symbol, [ptr, i64, i64, ptr], body.fn)
    addr = load_symbols(compile_object(str(module), host_target()), [symbol])[symbol]
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                            ctypes.c_void_p, ctypes.c_int64)(addr)


def read_each_gbps(threads: int, sizes: list[int], samples: int = 5) -> float:
    """GB/s of reading buffers of ``sizes`` bytes (on huge pages) one call each, in order, as a
    decode token's GEMVs read their weights (best of ``samples`` passes over all of them, after
    an untimed one): a plain read's speed for the same streams, each starting cold in its
    call, against which the linears' own speed in the model says what is the kernels' part."""
    fn = read_probe(simd.float_lanes(host_target()))
    sink = torch.zeros(64)
    bufs = [huge_pages.empty((max(n // 4 // 128, 1) * 128,), torch.float32).fill_(1.0)
            for n in sizes]
    calls = [(buf.data_ptr(), buf.numel(), 1, sink.data_ptr(), threads) for buf in bufs]

    def once():
        for args in calls:
            fn(*args)
    nbytes = sum(buf.numel() * 4 for buf in bufs)
    return nbytes / best(once, samples) / 1e9


def read_gbps(threads: int, nbytes: int, passes: int = 4, samples: int = 40) -> float:
    """GB/s of reading a ``nbytes`` float32 buffer ``passes`` times on ``threads`` threads (a
    first, untimed call warms it), best of ``samples`` calls: the L3's bandwidth for a buffer
    that fits it, the roofline of weight-streaming (decode) kernels for a weight-sized one."""
    fn = read_probe(simd.float_lanes(host_target()))
    # on huge pages, as Kwker's streamed weights are: the memory's best, not its TLB's (on the
    # Zen 4 KVM guest 4 KB pages read 23-29 GB/s where 2 MB ones read 32-53)
    buf = huge_pages.empty((nbytes // 4,), torch.float32).fill_(1.0)
    sink = torch.zeros(64)
    args = (buf.data_ptr(), buf.numel(), passes, sink.data_ptr(), threads)
    return nbytes * passes / best(lambda: fn(*args), samples) / 1e9
