"""int4 weights on AVX2: the folded tiles of gemm_lowbit.py, where no one-instruction 16-float
lookup exists (AVX-512 looks each nibble up in a table with ``vpermps``).

The nibbles ``u`` (``q + 8``) are summed against x as they are, each unit's sum (``unit =
min(group, chunk)`` weights) starting from its ``-(8 + zp) * sum(x)`` term, lane by lane:

    sum x (u - 8 - zp) s = s (sum x u - (8 + zp) sum x)

with x's sums per unit made once per call and stored, times -8, after each x row. Symmetric
weights start from them as stored: a load where an FMA took the term off at the unit's end
(Zen 3, one thread, int4 in groups of 32 from L2: 0.46-0.47 -> 0.44-0.45 ns per 8 weights,
alternating processes). The term is taken off inside the unit, not once per W row: a row's
sums of ``x u`` grow to ``8 sum x`` and cancel only at its end, ~10x the error where x has a
mean (x ~ N(5, 1), K 2048). Nibble ``j`` of a word is not shifted down: masked in place it
converts to ``u * 16**j`` exactly, and x holds ``x * 16**-j`` there, so each FMA's exact
product is ``x * u``: the sums are bit for bit those of shifted nibbles. 3 instructions per 8
weights (mask, convert, FMA) against 6-7 for the exact form; the products round differently
from torchao's dequantised weights, within float32 accumulation error.

x the fold cannot take keeps the exact tiles (``prepare_x`` says which): inf or NaN (the
``(8 + zp) * sum(x)`` term would be inf - inf), |x| >= ``FOLD_LIMIT`` (15 x |x| x K near
overflow), and nonzero |x| < ``FOLD_TINY`` (``x * 16**-6`` would be subnormal and lose digits).

Measured on Zen 3, 2 threads, in one process: GPT-2's 48 int4 layer linears (groups of 32)
7.7 -> 9.0-10.3 GB/s with the fold, its int4 decode 47 -> 52-59 tokens/s; with the nibbles in
place and one W row at a time in blocks of one row (2026-12-03): all 49 of its int4 linears
15.4-16.7 -> 18.8-19.9 GB/s, 3072 x 768 warm 82-104 -> 70-76 us, decode 108-117 -> 127-128
tokens/s.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd, vmath
from .irutil import Fn, const, f32, i8, i32, i64

FOLD_LIMIT = 2.0 ** 64
FOLD_TINY = 2.0 ** -100


def folds(bits: int, lanes: int) -> bool:
    """Whether int4 takes the folded tiles (no one-instruction 16-float lookup: AVX2)."""
    return bits == 4 and lanes != 16


def emit_tile(tiles, f: Fn, mr: int, rr: int) -> None:
    """The folded tile of ``mr`` x rows by ``rr`` W rows (see gemm_lowbit ``_Tile.get``). One W
    row at a time, all its chunks before the next row's, so that x is read from L1 rather than
    held in registers (the 8 rows of a chunk together spilled); the factory packs int4 for
    this path in blocks of one row, so a row is one sequential run of bytes."""
    b, L, s = f.b, tiles.L, tiles.s
    x, w, scale, zp, sums = f.args
    vt, it = simd.vty(L), simd.vty(L, i32)
    zero = vmath.splat(vt, 0.0)
    c, unit = tiles.chunk, tiles.unit
    per_unit = unit // L                           # vectors a unit
    stride = s.rr * L                              # words a chunk of the block's rows
    units = c // unit  # a total per unit of the chunk: independent FMA chains
    for r in range(rr):
        total = [[f.var(vt, zero, f"t{i}_{r}_{u}") for u in range(units)] for i in range(mr)]
        with f.for_range(0, tiles.kp // c, name=f"c{r}") as ci:
            at = b.add(b.mul(ci, const(i64, stride)), const(i64, r * L))
            if r == 0:  # the block's next bytes, over its first row's pass
                tiles.prefetch_int4(f, w, scale, ci, stride * 4, keep=False)
            k0 = b.mul(ci, const(i64, c))
            word = b.load(simd.gep(b, w, at, i32), typ=it, align=4)
            acc = [None] * mr
            for j in range(8):
                if j % per_unit == 0:   # a unit starts from its zero-point term
                    acc = _unit_start(f, tiles, x, zp, ci, k0, j, r, mr)
                if j < 7:  # u * 16**j, in place: x holds x * 16**-j there (prepare_x)
                    u = b.sitofp(b.and_(word, ir.Constant(it, [15 << 4 * j] * L)), vt)
                else:      # the top nibble as a signed int32 would be negative
                    u = b.sitofp(b.lshr(word, ir.Constant(it, [28] * L)), vt)
                for i in range(mr):
                    xv = simd.load_vec(b, x, b.add(k0, const(i64, i * tiles.xstride + j * L)), L)
                    acc[i] = vmath.fma(b, xv, u, acc[i])
                if (j + 1) % per_unit:
                    continue
                at_g = _group_at(f, tiles, ci, k0, j, r)
                sv = simd.broadcast(b, simd.load_scalar(b, scale, at_g), L)
                for i in range(mr):
                    t = total[i][j * L // unit]
                    t.set(vmath.fma(b, acc[i], sv, t.get()))
        for i in range(mr):
            row = total[i][0].get()
            for t in total[i][1:]:
                row = b.fadd(row, t.get())
            simd.store_scalar(b, simd.hsum(b, row), sums, const(i64, i * rr + r))


def _unit(f: Fn, tiles, ci, j: int):
    """The index (i64) of the unit holding vector ``j`` of chunk ``ci``."""
    b, c, unit = f.b, tiles.chunk, tiles.unit
    return b.add(b.mul(ci, const(i64, c // unit)), const(i64, j * tiles.L // unit))


def _group_at(f: Fn, tiles, ci, k0, j: int, r: int):
    """The scale (and zero point) index of vector ``j`` of chunk ``ci`` in W row ``r``."""
    b, s = f.b, tiles.s
    gi = _unit(f, tiles, ci, j) if tiles.unit == s.group else b.udiv(k0, const(i64, s.group))
    return b.add(gi, const(i64, r * tiles.ng))


def _unit_start(f: Fn, tiles, x, zp, ci, k0, j: int, r: int, mr: int) -> list:
    """Per x row, ``-(8 + zp) * sum(x)`` over the unit from vector ``j`` (lane by lane): the
    sum its products are added to. Symmetric weights read it as stored (``unit_sums``: ``-8 *
    sum(x)``), so it costs a load, not an FMA; with zero points, times ``(8 + zp) / 8`` (exact)."""
    b, L = f.b, tiles.L
    at = b.add(b.mul(_unit(f, tiles, ci, j), const(i64, L)), const(i64, tiles.xpad))
    starts = [simd.load_vec(b, x, b.add(at, const(i64, i * tiles.xstride)), L) for i in range(mr)]
    if not tiles.s.zero_point:
        return starts
    z = b.sitofp(simd.load_scalar(b, zp, _group_at(f, tiles, ci, k0, j, r), i8), f32)
    factor = simd.broadcast(b, b.fmul(b.fadd(z, ir.Constant(f32, 8.0)),
                                      ir.Constant(f32, 0.125)), L)
    return [b.fmul(v, factor) for v in starts]


def screen_x(f: Fn, v, bad) -> None:
    """Count into ``bad`` (an i64 variable) the lanes of x vector ``v`` the fold cannot take."""
    b, L = f.b, v.type.count
    vt = simd.vty(L)
    size = f.call_intrinsic(f"llvm.fabs.v{L}f32", vt, [v])
    big = b.fcmp_unordered(">=", size, vmath.splat(vt, FOLD_LIMIT))  # NaN: unordered, counted
    tiny = b.and_(b.fcmp_ordered("<", size, vmath.splat(vt, FOLD_TINY)),
                  b.fcmp_ordered("!=", size, vmath.splat(vt, 0.0)))
    bits = b.zext(b.bitcast(b.or_(big, tiny), ir.IntType(L)), i64)
    bad.set(b.or_(bad.get(), bits))


def unit_sums(f: Fn, tiles, row) -> None:
    """x row ``row`` (float32, zero past K): its sums per unit, a vector each (lane by lane),
    stored times -8 (exact) after its ``xpad`` floats: symmetric weights' zero-point term."""
    b, L = f.b, tiles.L
    vt = simd.vty(L)
    with f.for_range(0, tiles.kp // tiles.unit, name="xu") as u:
        at = b.mul(u, const(i64, tiles.unit))
        total = simd.load_vec(b, row, at, L)
        for v in range(1, tiles.unit // L):
            total = b.fadd(total, simd.load_vec(b, row, b.add(at, const(i64, v * L)), L))
        simd.store_vec(b, b.fmul(total, vmath.splat(vt, -8.0)), row,
                       b.add(b.mul(u, const(i64, L)), const(i64, tiles.xpad)))


def prepare_x(f: Fn, tiles, xbuf, rows, bad):
    """Whether the folded tiles may take the x rows in ``xbuf`` (i1: nothing counted in
    ``bad``); if so, nibble j's place value is moved onto x: ``x * 16**-j`` at nibble j of
    each chunk (exact there), the unit sums left as they are."""
    b, L, c = f.b, tiles.L, tiles.chunk
    vt = simd.vty(L)
    foldable = b.icmp_unsigned("==", bad.get(), const(i64, 0))
    with f.if_(foldable, likely=True):
        with f.for_range(0, rows, name="xs") as r:
            row = simd.gep(b, xbuf, b.mul(r, const(i64, tiles.xstride)))
            with f.for_range(0, tiles.kp // c, name="xc") as ci:
                for j in range(1, 7):
                    at = b.add(b.mul(ci, const(i64, c)), const(i64, j * L))
                    v = simd.load_vec(b, row, at, L)
                    simd.store_vec(b, b.fmul(v, vmath.splat(vt, 16.0 ** -j)), row, at)
    return foldable
