"""The prefill side of the low-bit linear: int8 / int4 weights dequantised per call.

``sym(w, scale, zp, dst, nthreads)`` writes the weights as the GEMM family's B operand, row-major
(N, ``ld``) float32 or bf16 (rounded once), exactly torchao's float32 ``(q - zp) * scale``; the
weights' layouts are gemm_lowbit.py's.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, omp, simd
from .gemm_lowbit import GRAIN, _start, _Tile, chunk
from .irutil import Fn, const, f32, i8, i16, i32, i64, ptr


def emit(spec, target) -> ir.Module:
    """``sym(w, scale, zp, dst, nthreads)``: the dequantised weights, row-major (N, ``ld``)
    float32 or bf16 (rounded once): the B operand of the prefill GEMM (``A @ B.T``), built per
    call and dropped after it, so the process holds no float copy between calls."""
    L, module, tiles, body, ctx = _start(spec, target)
    b = body.b
    w, scale, zp, dst = (ctx.ptr(slot) for slot in range(4))
    begin, end = omp.split(body, spec.n, body.args[1], body.args[2])
    wrow = tiles.kp if spec.bits == 8 else tiles.kp // 2
    elem = i16 if spec.dtype == "bf16" else f32
    with body.for_range(begin, end, name="row") as n:
        if spec.bits == 8:
            wr = simd.gep(b, w, b.mul(n, const(i64, wrow)), i8)
        else:  # blocks of rr rows, chunk-interleaved (see the module doc)
            rr = const(i64, spec.rr)
            first = b.mul(b.udiv(n, rr), const(i64, spec.rr * wrow))
            wr = simd.gep(b, w, b.add(first, b.mul(b.urem(n, rr), const(i64, 4 * L))), i8)
        _unpack_row(body, spec, tiles, wr,
                    simd.gep(b, scale, b.mul(n, const(i64, tiles.ng))),
                    simd.gep(b, zp, b.mul(n, const(i64, tiles.ng)), i8),
                    simd.gep(b, dst, b.mul(n, const(i64, spec.ld)), elem))
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 4, body.fn,
                      max_threads=max(1, spec.n * spec.k // GRAIN))
    return module


def _unpack_row(f: Fn, spec, tiles: _Tile, w, scale, zp, out) -> None:
    b, L, k = f.b, tiles.L, spec.k
    vt, it = simd.vty(L), simd.vty(L, i32)

    def put(v, at: ir.Value, first: int):
        """Store vector ``v`` of k ``first ..`` (compile-time when known) at ``at``."""
        active = L if first is None or first + L <= k else k - first
        if active > 0:
            bf16.store_as(b, spec.dtype, v, out, at, active)

    def scale_of(gi):
        return simd.broadcast(b, simd.load_scalar(b, scale, gi), L)

    def zp_of(gi):
        return b.sext(simd.load_scalar(b, zp, gi, i8), i32)

    if spec.bits == 8:
        full = k // L
        if full:
            with f.for_range(0, full, name="v") as v:
                at = b.mul(v, const(i64, L))
                gi = b.udiv(at, const(i64, spec.group))
                q = b.sext(tiles._load_i8(b, w, at, L), it)
                if spec.zero_point:
                    q = b.sub(q, simd.broadcast(b, zp_of(gi), L))
                put(b.fmul(b.sitofp(q, vt), scale_of(gi)), at, None)
        if k % L:
            at = const(i64, full * L)
            gi = b.udiv(at, const(i64, spec.group))
            q = b.sext(tiles._load_i8(b, w, at, k % L), it)
            if spec.zero_point:
                q = b.sub(q, simd.broadcast(b, zp_of(gi), L))
            put(b.fmul(b.sitofp(q, vt), scale_of(gi)), at, full * L)
        return
    c = chunk(4, L)
    full = k // c          # whole chunks inside K; the chunk holding K's end is stored masked
    for part in (("loop", full), ("tail", 1 if k % c else 0)):
        kind, count = part
        if not count:
            continue

        def one_chunk(ci, k0_known):
            word = b.load(simd.gep(b, w, b.mul(ci, const(i64, spec.rr * L)), i32), typ=it,
                          align=4)
            k0 = b.mul(ci, const(i64, c))
            for j in range(8):
                first = None if k0_known is None else k0_known + j * L
                if first is not None and first >= k:
                    break
                gi = b.udiv(b.add(k0, const(i64, j * L)), const(i64, spec.group))
                u = b.and_(b.lshr(word, ir.Constant(it, [4 * j] * L)) if j else word,
                           ir.Constant(it, [15] * L))
                q = b.sub(u, ir.Constant(it, [8] * L))
                if spec.zero_point:
                    q = b.sub(q, simd.broadcast(b, zp_of(gi), L))
                put(b.fmul(b.sitofp(q, vt), scale_of(gi)), b.add(k0, const(i64, j * L)),
                    first)

        if kind == "loop":
            with f.for_range(0, count, name="c") as ci:
                one_chunk(ci, None)
        else:
            one_chunk(const(i64, full), full * c)
