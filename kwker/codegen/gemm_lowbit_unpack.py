"""The prefill side of the low-bit linear: int8 / int4 weights dequantised per call.

``emit_slice``: a block of W rows and a K range into a small buffer, exactly torchao's float32
``(q - zp) * scale`` (bf16: rounded once), the weights in gemm_lowbit.py's layouts. The GEMM
driver calls it as it packs each L2 block of B panels (``GemmSpec.b_bits``, codegen/gemm.py), a
panel's rows a piece of K at a time: the dequantised weights exist only there, in L1, between
the int8 / int4 rows and the packed panels. This replaced a whole dequantised copy per call,
written to memory and packed again, on the vector path (GPT-2, 128 rows, float32, Zen 5: see the
README) and on the tiles (kernels/linear_lowbit_prefill.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import bf16, simd
from .gemm_lowbit import _Tile, chunk
from .irutil import Fn, const, defined, f32, i8, i16, i32, i64, ptr, void


@dataclass(frozen=True)
class WeightFormat:
    """How the GEMM's low-bit B is stored (the fields gemm_lowbit's layouts depend on)."""
    bits: int
    k: int             # real K of a W row
    group: int
    zero_point: bool
    rr: int            # int4: rows per block of the packed layout
    dtype: str         # of the dequantised values ("f32" | "bf16")


def emit_slice(module: ir.Module, fmt: WeightFormat, target, ld: int) -> ir.Function:
    """``void unpack_slice(ptr w, ptr scale, ptr zp, i64 row0, i64 rows, i64 k0, i64 kn,
    ptr dst)``: ``dst[r * ld + j] = deq(W)[row0 + r, k0 + j]`` for ``r < rows``, ``j < kn``.
    ``k0`` is a multiple of the vector width (int4: of its chunk), and ``k0 + kn`` too unless it
    is K. bf16 with an odd K: the slice that ends at K also zeroes the pad element after it."""
    name = (f"unpack_slice.q{fmt.bits}.k{fmt.k}.g{fmt.group}{'z' if fmt.zero_point else ''}"
            f".r{fmt.rr}.{fmt.dtype}.ld{ld}")
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, ptr, ptr, i64, i64, i64, i64, ptr],
           ["w", "scale", "zp", "row0", "rows", "k0", "kn", "dst"])
    f.fn.attributes.add("noinline")
    w, scale, zp, row0, rows, k0, kn, dst = f.args
    b = f.b
    tiles = _Tile(module, fmt, target)
    elem = i16 if fmt.dtype == "bf16" else f32
    with f.for_range(0, rows, name="row") as r:
        wr, sr, zr = _row_ptrs(b, fmt, tiles, w, scale, zp, b.add(row0, r))
        out = simd.gep(b, dst, b.mul(r, const(i64, ld)), elem)
        # bf16 rounded by vcvtneps2bf16 where it runs: one instruction where the emulated
        # rounding takes nine (GPT-2's 2304 x 768 int8 weights, 128 bf16 rows, on AMX tiles:
        # the dequantisation was 28% of the product)
        _unpack_row(f, fmt, tiles, wr, sr, zr, out, k0, kn, bf16.native(target))
        if fmt.dtype == "bf16" and fmt.k % 2:
            with f.if_(b.icmp_signed("==", b.add(k0, kn), const(i64, fmt.k))):
                simd.store_scalar(b, const(i16, 0), out, kn)
    return f.finish()


def _row_ptrs(b: ir.IRBuilder, spec, tiles: _Tile, w, scale, zp, n) -> tuple:
    """(weights, scales, zero points) of W row ``n``."""
    if spec.bits == 8:
        wr = simd.gep(b, w, b.mul(n, const(i64, tiles.kp)), i8)
    else:  # blocks of rr rows, chunk-interleaved (see gemm_lowbit's module doc)
        rr, wrow = const(i64, spec.rr), tiles.kp // 2
        first = b.mul(b.udiv(n, rr), const(i64, spec.rr * wrow))
        wr = simd.gep(b, w, b.add(first, b.mul(b.urem(n, rr), const(i64, 4 * tiles.L))), i8)
    return (wr, simd.gep(b, scale, b.mul(n, const(i64, tiles.ng))),
            simd.gep(b, zp, b.mul(n, const(i64, tiles.ng)), i8))


def _unpack_row(f: Fn, spec, tiles: _Tile, w, scale, zp, out, k0, kn, native: bool) -> None:
    """``out[j] = deq(W row)[k0 + j]`` for ``j < kn`` (see ``emit_slice`` for the bounds;
    ``native``: bf16 rounded by ``vcvtneps2bf16``)."""
    b, L, k = f.b, tiles.L, spec.k
    vt, it = simd.vty(L), simd.vty(L, i32)
    end = b.add(k0, kn)
    at_end = b.icmp_signed("==", end, const(i64, k))

    def put(v, at: ir.Value, first: int | None):
        """Store vector ``v`` of k ``at`` (``first``: the same, when known at compile time)."""
        active = L if first is None or first + L <= k else k - first
        if active > 0:
            bf16.store_as(b, spec.dtype, v, out, b.sub(at, k0), active, native)

    def scale_of(gi):
        return simd.broadcast(b, simd.load_scalar(b, scale, gi), L)

    def zp_of(gi):
        return b.sext(simd.load_scalar(b, zp, gi, i8), i32)

    def deq(q, gi):
        if spec.zero_point:
            q = b.sub(q, simd.broadcast(b, zp_of(gi), L))
        return b.fmul(b.sitofp(q, vt), scale_of(gi))

    def clamp(x, limit: int):
        return b.select(b.icmp_signed("<", x, const(i64, limit)), x, const(i64, limit))

    if spec.bits == 8:
        full = k // L * L                           # whole vectors inside K
        with f.for_range(k0, clamp(end, full), step=L, name="v") as at:
            gi = b.udiv(at, const(i64, spec.group))
            put(deq(b.sext(tiles._load_i8(b, w, at, L), it), gi), at, None)
        if k % L:
            with f.if_(at_end):
                at = const(i64, full)
                gi = b.udiv(at, const(i64, spec.group))
                put(deq(b.sext(tiles._load_i8(b, w, at, k % L), it), gi), at, full)
        return
    c = chunk(4, L)
    full = k // c          # whole chunks inside K; the chunk holding K's end is stored masked

    def one_chunk(ci, k0_known):
        word = b.load(simd.gep(b, w, b.mul(ci, const(i64, spec.rr * L)), i32), typ=it, align=4)
        kc0 = b.mul(ci, const(i64, c))
        for j in range(8):
            first = None if k0_known is None else k0_known + j * L
            if first is not None and first >= k:
                break
            at = b.add(kc0, const(i64, j * L))
            u = b.and_(b.lshr(word, ir.Constant(it, [4 * j] * L)) if j else word,
                       ir.Constant(it, [15] * L))
            put(deq(b.sub(u, ir.Constant(it, [8] * L)), b.udiv(at, const(i64, spec.group))),
                at, first)

    with f.for_range(b.udiv(k0, const(i64, c)), clamp(b.udiv(end, const(i64, c)), full),
                     name="c") as ci:
        one_chunk(ci, None)
    if k % c:
        with f.if_(at_end):
            one_chunk(const(i64, full), full * c)
