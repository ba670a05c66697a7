"""int4 weights packed into the nibble layout of gemm_lowbit.py, at the speed of memory.

    void sym(ptr q, ptr out, i64 ld, i64 n, i64 threads)

``q``: (n, K) int8 values in [-8, 7], rows ``ld`` bytes apart (checked by the caller);
``out``: int32 words ``(rows / rr, chunks, rr, lanes)`` for ``rows`` = n rounded up to whole
blocks of ``rr``: per chunk of ``8 * lanes`` weights of a row, weight ``j * lanes + l`` in
nibble ``j`` of word ``l`` as ``q + 8``; past K and past n the nibbles hold 8 (weight 0). The
same words as the byte-wise torch packing the factory used before (kept in the tests as the
reference), which took 2.5 s for the weight-stream measurement's 512 MB synthetic weight and
runs on every process's load of an int4 model. Threads take whole blocks of rows.
"""
from __future__ import annotations

from llvmlite import ir

from . import omp, simd, vmath
from .irutil import const, i8, i32, i64, new_module, ptr

PAD = 0x88888888 - (1 << 32)   # a word of eight nibbles of 8 (weight 0), as a signed i32


def emit(spec, target):
    lanes, k, kp, rr = spec.lanes, spec.k, spec.kp, spec.rr
    span = 8 * lanes   # weights of one chunk
    if k < 1 or kp % span or kp < k or rr < 1 or lanes < 1:
        raise ValueError(f"kwker int4_pack: no layout for {spec}")
    module = new_module(spec.symbol)
    f = omp.body_fn(module, f"{spec.symbol}.body")
    b = f.b
    ctx = omp.Context(f, f.args[0])
    q, out, ld, n = ctx.ptr(0), ctx.ptr(1), ctx.i64(2), ctx.i64(3)
    blocks = b.sdiv(b.add(n, const(i64, rr - 1)), const(i64, rr))
    begin, end = omp.split(f, blocks, f.args[1], f.args[2])
    chunks, full = kp // span, k // span
    wt = ir.VectorType(i32, lanes)
    pad, eight = vmath.splat(wt, PAD), vmath.splat(wt, 8)

    def word(row_at, c0: ir.Value, first: int | None = None) -> ir.Value:
        """The ``lanes`` words of the chunk whose first weight is ``c0`` (i64) of the row at
        ``row_at``; ``first``: that weight as a compile-time number (the partial chunk)."""
        acc = vmath.splat(wt, 0)
        for j in range(8):
            live = lanes if first is None else min(lanes, k - first - j * lanes)
            if live <= 0:
                v = eight
            else:
                at = b.add(c0, const(i64, j * lanes))
                v = b.add(b.sext(simd.load_any(b, row_at, at, lanes, live, elem=i8), wt), eight)
            shifted = b.shl(v, vmath.splat(wt, 4 * j)) if j else v
            acc = b.or_(acc, shifted)
        return acc

    def store(value, blk, c, r) -> None:
        at = b.mul(b.add(b.mul(b.add(b.mul(blk, const(i64, chunks)), c), const(i64, rr)), r),
                   const(i64, lanes))
        simd.store_vec(b, value, out, at, elem=i32)

    with f.for_range(begin, end, name="blk") as blk:
        with f.for_range(0, rr, name="r") as r:
            row = b.add(b.mul(blk, const(i64, rr)), r)
            with f.if_else(b.icmp_signed("<", row, n)) as (live, padding):
                with live:
                    row_at = b.gep(q, [b.mul(row, ld)], source_etype=i8)
                    if full:
                        with f.for_range(0, full, name="c") as c:
                            store(word(row_at, b.mul(c, const(i64, span))), blk, c, r)
                    for c in range(full, chunks):   # the partial chunk, then padding
                        value = word(row_at, const(i64, c * span), c * span) if c * span < k \
                            else pad
                        store(value, blk, const(i64, c), r)
                with padding:
                    with f.for_range(0, chunks, name="cp") as c:
                        store(pad, blk, c, r)
    f.finish()
    omp.emit_parallel(module, spec.symbol, [ptr, ptr, i64, i64], f.fn)
    return module
