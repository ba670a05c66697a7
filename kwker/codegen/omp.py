"""Fork/join over torch's OpenMP pool for kernels with a direct-argument ABI.

``emit_parallel`` exports ``symbol(arg0, ..., nthreads)``: the arguments are stored in a context
block on the caller's stack, and ``GOMP_parallel`` (the libgomp torch loaded, so
``torch.set_num_threads`` applies; ~2 us fork/join) runs ``body(ctx, tid, nt)`` on every thread.
With ``nthreads <= 1`` the body runs on the calling thread without a fork. How the work is split is
the body's business (GEMM splits M/N tiles, never K).
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i32, i64, intrinsic, ptr, void


class Context:
    """Typed access to the context block inside a body: ``ctx.ptr(i)``, ``ctx.i64(i)``."""

    def __init__(self, fn: Fn, block: ir.Value):
        self.fn, self.block = fn, block

    def i64(self, slot: int) -> ir.Value:
        return self.fn.arg_i64(self.block, slot)

    def ptr(self, slot: int) -> ir.Value:
        return self.fn.arg_ptr(self.block, slot)


def body_fn(module: ir.Module, name: str) -> Fn:
    """A body ``void name(ptr ctx, i64 tid, i64 nt)``; fill it, then ``finish()`` it."""
    return Fn(module, name, void, [ptr, i64, i64], ["ctx", "tid", "nt"])


def emit_parallel(module: ir.Module, symbol: str, arg_types: list[ir.Type],
                  body: ir.Function, max_threads=None) -> ir.Function:
    """Export ``void symbol(*args, i64 nthreads)`` forking ``body`` over up to ``nthreads``.

    ``max_threads`` caps the team for kernels too small to pay for more threads: an int, or
    for sizes known at call time ``max_threads(builder, args) -> i64 value``.
    """
    gomp = intrinsic(module, "GOMP_parallel", void, [ptr, ptr, i32, i32])
    tnum = intrinsic(module, "omp_get_thread_num", i32, [])
    tcount = intrinsic(module, "omp_get_num_threads", i32, [])

    outlined = Fn(module, f"{symbol}.omp", void, [ptr], ["ctx"])
    t = outlined.b.sext(outlined.b.call(tnum, []), i64)
    n = outlined.b.sext(outlined.b.call(tcount, []), i64)
    outlined.b.call(body, [outlined.args[0], t, n])
    outlined.finish()

    names = [f"a{i}" for i in range(len(arg_types))] + ["nthreads"]
    main = Fn(module, symbol, void, list(arg_types) + [i64], names, internal=False)
    b = main.b
    with b.goto_block(main.entry):
        block = b.alloca(i64, size=max(1, len(arg_types)), name="ctx")
    for slot, a in enumerate(main.args[:-1]):
        v = b.ptrtoint(a, i64) if isinstance(a.type, ir.PointerType) else a
        main.store(v, block, const(i64, slot))  # read back as ptr by Context.ptr
    nthreads = main.args[-1]
    if max_threads is not None:
        cap = (max_threads(b, main.args[:-1]) if callable(max_threads)
               else const(i64, max(1, max_threads)))
        nthreads = b.select(b.icmp_signed("<", nthreads, cap), nthreads, cap)
    with main.if_else(b.icmp_signed("<=", nthreads, const(i64, 1))) as (serial, par):
        with serial:
            b.call(body, [block, const(i64, 0), const(i64, 1)])
        with par:
            b.call(gomp, [outlined.fn, block, b.trunc(nthreads, i32), const(i32, 0)])
    return main.finish()


def per_grain(b: ir.IRBuilder, elements: ir.Value, grain: int) -> ir.Value:
    """``max(1, elements // grain)``: a ``max_threads`` cap computed at call time, for kernels
    whose threads pay only from ``grain`` elements each."""
    cap = b.udiv(elements, const(i64, grain))
    return b.select(b.icmp_signed("<", cap, const(i64, 1)), const(i64, 1), cap)


def split(fn: Fn, total, tid: ir.Value, nt: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Contiguous share [begin, end) of ``total`` items for thread ``tid`` of ``nt``."""
    b = fn.b
    total = fn.i64(total)
    begin = b.sdiv(b.mul(total, tid), nt)
    end = b.sdiv(b.mul(total, b.add(tid, const(i64, 1))), nt)
    return begin, end
