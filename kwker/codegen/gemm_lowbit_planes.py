"""int8 prefill on int8 matrix tiles, exact to float32: x's byte planes times the weights.

The decode kernel's byte planes (gemm_lowbit_vnni.py) make many x rows an unsigned int8 matrix
of three rows per x row; times the int8 weights on the u8s8 tile GEMM (``tdpbusd``, gemm_tile.py)
they give each plane's int32 sums, which combine into the linear (``combine_planes``):

    y = (S0 + 2**8 S1 + 2**16 S2 - 2**23 sum_k q) * 2**(E - 22) * scale[n] + bias[n]

then the activation, the residual and one rounding to the model's dtype. The three planes cost
1.5x a bf16 product on the tiles (``tdpbusd`` does twice ``tdpbf16ps``'s products), against
the float32 FMAs of dequantised weights the prefill ran before. Where the user allows float32
products below full precision (``torch.set_float32_matmul_precision("high")`` or ``"medium"``),
x takes two planes (16 bits, x to 2**-15 of its row's largest |x|, finer than TF32's 2**-11 a
value):

    y = (S0 + 2**8 S1 - 2**15 sum_k q) * 2**(E - 14) * scale[n] + bias[n]

which is the cost of a bf16 product on the tiles, and on ``vpdpbusd`` 2/3 of the three planes'.

The kernels of this module, per call:

- ``lowbit_planes``: x rows -> their planes (rows of ``plane_stride(K)`` bytes) and heads;
- ``lowbit_panels``: a block of W rows (int8, row-major, read in place) -> AMX's B layout, the
  u8s8 GEMM's pre-packed panels (32 columns, a 32-bit word of 4 k per column, K zero-padded to
  whole tile steps), so no packed copy of the weights outlives the call;
- ``lowbit_combine``: after the tile GEMM, its float32 plane sums (exact integers below 2**24,
  rounded to float32 above) -> the output columns of the block. (On ``vpdpbusd`` the GEMM's
  micro-kernel combines them in its epilogue, ``GemmSpec.planes``: its 12-row tiles hold whole
  x rows, the tiles' 32-row blocks do not.) Rows whose head says "float path" (non-finite or
  tiny x) are left alone: the factory runs them through the decode kernel.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, omp, simd
from .gemm_lowbit_vnni import (
    HEAD,
    combine_planes,
    emit_planes,
    is_ready,
    load_factor,
    row_bytes,
)
from .gemm_micro import epilogue_masked
from .gemm_tile import STEP as TILE_STEP
from .gemm_tile import TILE_BLOCK
from .irutil import const, i8, i32, i64, new_module, ptr

NR = TILE_BLOCK[1]


def panel_words(k: int) -> int:
    """k-quad words of a panel (a word of 4 k per column): K padded to whole tile steps."""
    quads = -(-k // 4)
    return -(-quads // TILE_STEP) * TILE_STEP


def emit(spec, target) -> ir.Module:
    return {"lowbit_planes": _emit_planes, "lowbit_panels": _emit_panels,
            "lowbit_combine": _emit_combine}[spec.family](spec, target)


def _parallel(spec, slots: int, total_of):
    """(module, body, the ``slots`` pointer arguments, the thread's [begin, end)) of a kernel
    whose threads split ``total_of(context)`` items."""
    module = new_module(spec.symbol)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    args = [ctx.ptr(i) for i in range(slots)]
    begin, end = omp.split(body, total_of(ctx), body.args[1], body.args[2])
    return module, body, args, (begin, end)


def _emit_planes(spec, target) -> ir.Module:
    """``sym(x, planes, heads, rows, nthreads)``."""
    module, body, (x, planes, heads), (begin, end) = _parallel(
        spec, 3, lambda ctx: ctx.i64(3))
    b = body.b
    elem_bytes = bf16.itemsize(spec.dtype)
    xs = simd.gep(b, x, b.mul(begin, const(i64, spec.k * elem_bytes)), i8)
    ps = simd.gep(b, planes, b.mul(begin, const(i64, row_bytes(spec.k, spec.planes))), i8)
    hs = simd.gep(b, heads, b.mul(begin, const(i64, HEAD)), i8)
    emit_planes(body, spec.k, spec.dtype, xs, ps, hs, b.sub(end, begin), spec.planes)
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 3 + [i64], body.fn)
    return module


def _emit_panels(spec, target) -> ir.Module:
    """``sym(w, panels, nthreads)``: W rows ``0 .. n`` (K int8 each) -> ``ceil(n / 32)`` panels
    of ``panel_words(K)`` rows of 32 words, zero past N and K. Threads split the panels; per
    16 rows and 16 k-quads, 16 loads of 64 bytes, a 16 x 16 transpose of words in registers and
    16 stores (a word at a time was 4x the instructions)."""
    np_ = -(-spec.n // NR)
    module, body, (w, panels), (begin, end) = _parallel(
        spec, 2, lambda ctx: const(i64, np_))
    b, k = body.b, spec.k
    kw = panel_words(k)
    vt = ir.VectorType(i32, 16)
    bt = ir.VectorType(i8, 64)
    zero = ir.Constant(vt, [0] * 16)
    with body.for_range(begin, end, name="p") as p:
        dst = simd.gep(b, panels, b.mul(p, const(i64, kw * NR)), i32)
        for half in range(NR // 16):
            rows = [b.add(b.mul(p, const(i64, NR)), const(i64, half * 16 + j))
                    for j in range(16)]
            live = [b.icmp_signed("<", n, const(i64, spec.n)) for n in rows]
            # a row past N reads row N - 1 (valid memory) and is zeroed
            src = [simd.gep(b, w, b.mul(b.select(ok, n, const(i64, spec.n - 1)),
                                        const(i64, k)), i8) for n, ok in zip(rows, live)]

            def chunk(c, valid: int):
                at = b.mul(c, const(i64, 64))
                vs = []
                for row, ok in zip(src, live):
                    raw = simd.load_any(b, row, at, 64, valid, elem=i8) if valid > 0 else \
                        ir.Constant(bt, [0] * 64)
                    vs.append(b.select(ok, b.bitcast(raw, vt), zero))
                for t, v in enumerate(_transpose16(b, vs)):
                    q = b.add(b.mul(c, const(i64, 16)), const(i64, t))
                    b.store(v, simd.gep(b, dst, b.add(b.mul(q, const(i64, NR)),
                                                      const(i64, half * 16)), i32), align=4)

            if k // 64:
                with body.for_range(0, k // 64, name="c") as c:
                    chunk(c, 64)
            for c in range(k // 64, kw // 16):   # the tail chunk, then zero padding
                chunk(const(i64, c), k - 64 * c if k > 64 * c else 0)
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 2, body.fn)
    return module


def _transpose16(b, vs: list) -> list:
    """The 16 x 16 transpose of 16 vectors of 16 words: four levels, each swapping the
    off-diagonal blocks of half the previous size between pairs of vectors."""
    vs = list(vs)
    mt = ir.VectorType(i32, 16)
    size = 8
    while size:
        lo = [lane if not lane & size else 16 + lane - size for lane in range(16)]
        hi = [lane + size if not lane & size else 16 + lane for lane in range(16)]
        for i in range(16):
            if not i & size:
                a, c = vs[i], vs[i | size]
                vs[i] = b.shuffle_vector(a, c, ir.Constant(mt, lo))
                vs[i | size] = b.shuffle_vector(a, c, ir.Constant(mt, hi))
        size //= 2
    return vs


def _emit_combine(spec, target) -> ir.Module:
    """``sym(sums, heads, wsum, scale, bias, res, out, rows, nthreads)``: ``sums``
    (``spec.planes`` rows per x row, ``spec.n`` floats each) -> ``out`` (row stride ``spec.ld``,
    as ``res``) for the rows whose head says planes; ``wsum`` int32, ``scale`` and ``bias``
    float32, ``spec.n`` each."""
    module, body, (sums, heads, wsum, scale, bias, res, out), (begin, end) = _parallel(
        spec, 7, lambda ctx: ctx.i64(7))
    b, n, L, count = body.b, spec.n, simd.float_lanes(target), spec.planes
    vt = simd.vty(L)
    with body.for_range(begin, end, name="r") as r:
        head = simd.gep(b, heads, b.mul(r, const(i64, HEAD)), i8)
        with body.if_(is_ready(b, head)):
            factor = load_factor(b, head, L)
            srow = b.mul(r, const(i64, count * n))
            orow = b.mul(r, const(i64, spec.ld))
            with body.for_range(0, n, step=L, name="c") as c:
                mask = simd.lane_mask(b, L, b.sub(const(i64, n), c))
                s = [simd.masked_load(b, sums, b.add(srow, b.add(c, const(i64, p * n))), mask, L)
                     for p in range(count)]
                qs = b.sitofp(simd.masked_load(b, wsum, c, mask, L, elem=i32), vt)
                v = combine_planes(b, s, qs, factor, simd.masked_load(b, scale, c, mask, L),
                                   count)
                epilogue_masked(b, v, simd.masked_load(b, bias, c, mask, L) if spec.bias
                                else None, spec.epilogue, res if spec.residual else None, out,
                                b.add(orow, c), mask, L, spec.dtype)
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 7 + [i64], body.fn)
    return module
