"""bfloat16 operand layouts of the attention kernel (codegen/attention.py).

Two ways to feed bf16 q/k/v to the GEMM micro-kernel (gemm_micro.py):

- widened (every ISA): K and V widened once per kv head per thread into float32 scratch
  (``emit_widen``), the rows of a Q block once per block; the float32 micro-kernel (FMA) runs
  on them.
- k pairs (CPUs with AVX512_BF16): the micro-kernel's ``dpbf16`` mode, whose A and B hold 32-bit
  words of two bf16 along the contraction axis, the even index in the low half.

  S = Q K^T contracts over e: a Q block is copied as rows of ``ep = ceil(e/2)`` words
  (``emit_pair_rows``, a zero high half past an odd e), K is packed once per kv head into
  ``nr``-key panels of word rows, ``panel[p][j] = (K[j][2p], K[j][2p+1])`` (``emit_pack_k_pairs``,
  in-register transposes of L x L words).
  O += P V contracts over keys: P (float32 after the exp) is rounded to bf16 in place over the
  first half of its own score row, so row r of the S buffer read as words is
  ``(P[r][2j], P[r][2j+1])``; V is packed once per kv head into rows of key pairs,
  ``vp[j][c] = (V[2j][c], V[2j+1][c])``, ``ev_pad`` words wide (``emit_pack_v_pairs``). An odd
  key count gets a zero high half in V, and P is 0 past the block's keys (the softmax stores
  whole vectors), so pairs that straddle the end add nothing.

Rounding P to bf16 is what ATen's own bf16 flash attention does for its bf16 GEMM (the softmax
sum stays the float32 sum of the unrounded exponentials, as there); its mean error then equals
ATen's. ATen takes that kernel only for e == ev (else its math path, in float32), so P is
rounded only then; otherwise O += P V stays widened (float32 P, FMAs). The probabilities that are
rounded come from ``exp2_p`` (six vector ops) and are rounded by ``vcvtneps2bf16`` (``store_p``).
"""
from __future__ import annotations

from contextlib import nullcontext

from llvmlite import ir

from . import bf16, simd, vmath
from .attention_args import iadd, imul
from .gemm_pack import emit_pack_cols, transpose
from .irutil import Fn, const, defined, i1, i16, i32, i64, intrinsic, ptr, void


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _load_i16(b: ir.IRBuilder, base, index, lanes: int, mask) -> ir.Value:
    """``lanes`` raw bf16 (i16) at ``base[index]``, lanes off in ``mask`` read as 0."""
    vt = ir.VectorType(i16, lanes)
    fn = intrinsic(b.module, f"llvm.masked.load.v{lanes}i16.p0", vt,
                   [ptr, i32, ir.VectorType(i1, lanes), vt])
    return b.call(fn, [simd.gep(b, base, index, i16), const(i32, 2), mask,
                       ir.Constant(vt, [ir.Constant(i16, 0)] * lanes)])


def splat_bit(b: ir.IRBuilder, bit: ir.Value, lanes: int) -> ir.Value:
    """An i1 vector of ``lanes`` copies of ``bit``."""
    vt = ir.VectorType(i1, lanes)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), bit, const(i32, 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


def emit_widen(module: ir.Module, L: int, cols: int, src_ld: int, dst_ld: int) -> ir.Function:
    """``void widen(ptr src, i64 rows, ptr dst)``: ``rows`` x ``cols`` bf16 (row stride
    ``src_ld``) to float32 (row stride ``dst_ld``); when ``dst_ld`` reaches past ``cols`` to a
    whole vector, the padding lanes are written as 0."""
    name = f"widen_rows.{L}.{cols}.{src_ld}.{dst_ld}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr], ["src", "rows", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, dst = f.args
    b = f.b
    full = cols // L * L
    with f.for_range(0, rows, name="r") as r:
        s0, d0 = b.mul(r, const(i64, src_ld)), b.mul(r, const(i64, dst_ld))
        with f.for_range(0, full, step=L, name="c") as c:
            simd.store_vec(b, bf16.load(b, src, b.add(s0, c), L), dst, b.add(d0, c))
        if cols > full:
            x = bf16.load(b, src, b.add(s0, const(i64, full)), L, cols - full)
            simd.store_any(b, x, dst, b.add(d0, const(i64, full)),
                           L if dst_ld >= full + L else cols - full)
    return f.finish()


def emit_pair_rows(module: ir.Module, L: int, e: int, src_ld: int,
                   words: int | None = None) -> ir.Function:
    """``void pair_rows(ptr src, i64 rows, ptr dst)``: ``rows`` x ``e`` bf16 (row stride
    ``src_ld``) into rows of ``words`` words (default ``ceil(e/2)``; a copy, zero past ``e``:
    an odd ``e`` gets a zero last half, longer rows zero words)."""
    words = words or _cdiv(e, 2)
    name = f"pair_rows.{L}.{e}.{src_ld}" + (f".{words}" if words != _cdiv(e, 2) else "")
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr], ["src", "rows", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, dst = f.args
    b = f.b
    H = 2 * L                       # bf16 per vector
    dst_ld = 2 * words              # in bf16
    with f.for_range(0, rows, name="r") as r:
        s0, d0 = b.mul(r, const(i64, src_ld)), b.mul(r, const(i64, dst_ld))
        for c in range(0, dst_ld, H):
            if c >= e:
                x = ir.Constant(ir.VectorType(i16, H), [0] * H)
            else:
                x = _load_i16(b, src, b.add(s0, const(i64, c)), H, simd.const_mask(H, e - c))
            n = min(H, dst_ld - c)
            addr = simd.gep(b, dst, b.add(d0, const(i64, c)), i16)
            if n == H:
                b.store(x, addr, align=2)
            else:
                st = intrinsic(module, f"llvm.masked.store.v{H}i16.p0", ir.VoidType(),
                               [x.type, ptr, i32, ir.VectorType(i1, H)])
                b.call(st, [x, addr, const(i32, 2), simd.const_mask(H, n)])
    return f.finish()


def emit_pack_k_pairs(module: ir.Module, L: int, nr: int, e: int, ld: int) -> ir.Function:
    """``void pack_k_pairs(ptr src, i64 rows, ptr dst)``: K (``rows`` keys x ``e`` bf16, row
    stride ``ld``) into ``nr``-key panels of ``ep_pad`` word rows (``ep = ceil(e/2)`` rounded up
    to whole vectors; the micro-kernel reads ``ep``): ``dst[t][p][j] = (K[t nr + j][2p],
    K[t nr + j][2p + 1])``, zero past ``rows`` keys and past ``e``. Per block of L keys x L
    words: L row loads of 2L bf16, one L x L transpose of words, L stores."""
    name = f"pack_k_pairs.{L}.{nr}.{e}.{ld}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr], ["src", "rows", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, dst = f.args
    b = f.b
    H, wt = 2 * L, ir.VectorType(i32, L)
    ep_pad = pair_rows_padded(e, L)
    tiles = b.sdiv(b.add(rows, const(i64, nr - 1)), const(i64, nr))
    # run-time loops over the blocks, not unrolled ones: the L x L transposes are most of this
    # function's compile time. AVX2 keeps the word blocks unrolled: its masked 16-bit loads
    # are scalarised unless the column mask is a constant (4-6x slower packing)
    with f.for_range(0, tiles, name="t") as t:
        tile_dst = b.mul(t, const(i64, nr * ep_pad))
        with f.for_range(0, nr, step=L, name="rg") as rg:
            first = b.add(b.mul(t, const(i64, nr)), rg)
            live = [splat_bit(b, b.icmp_signed("<", b.add(first, const(i64, j)), rows), H)
                    for j in range(L)]

            def block(p0, cmask):
                words = []
                for j in range(L):
                    idx = b.add(b.mul(b.add(first, const(i64, j)), const(i64, ld)),
                                b.mul(p0, const(i64, 2)))
                    words.append(b.bitcast(_load_i16(b, src, idx, H, b.and_(cmask, live[j])),
                                           wt))
                for kk, col in enumerate(transpose(b, words)):
                    idx = b.add(tile_dst, b.add(b.mul(b.add(p0, const(i64, kk)),
                                                      const(i64, nr)), rg))
                    b.store(col, simd.gep(b, dst, idx, i32), align=4)

            if L >= 16:
                with f.for_range(0, ep_pad, step=L, name="p0") as p0:
                    block(p0, simd.lane_mask(b, H, b.sub(const(i64, e), b.mul(p0, const(i64, 2)))))
            else:
                for p0 in range(0, ep_pad, L):
                    block(const(i64, p0), simd.const_mask(H, e - 2 * p0))
    return f.finish()


def store_p(b: ir.IRBuilder, p: ir.Value, base: ir.Value, index) -> None:
    """Round 16 float32 probabilities to bf16 with ``vcvtneps2bf16`` (round to nearest even,
    as ``bf16.narrow``, except that a P below FLT_MIN becomes 0: nothing next to the row's
    max of 1) and store them at bf16 index ``index``."""
    b.store(bf16.narrow(b, p, native=True), simd.gep(b, base, index, i16), align=2)


# 2**f = 1 + f (c1 + f (c2 + f (c3 + f c4))) on [0, 1): relative error 2.9e-6 (a minimax fit),
# far below the 2**-9 of the bf16 rounding that follows
EXP2_P4 = (0.013426697252383789, 0.05224245112338989, 0.24128021744647005, 0.6930448428013725)


def exp2_p(b: ir.IRBuilder, t: ir.Value) -> ir.Value:
    """2**t for softmax arguments in log2 units (t <= 0 or -inf), 16 lanes, AVX-512: the
    probabilities that are rounded to bf16 next. ``vreduceps`` splits off f = t - floor(t),
    ``vscalefps`` multiplies by 2**floor(t): six vector ops (ten in vmath.exp2_softmax). No
    clamp: -inf reduces to a finite f and ``vscalefps`` by -inf gives exactly 0 (fully masked
    rows stay 0); t = 0 gives exactly 1."""
    ty = t.type
    i16t = ir.IntType(16)
    reduce = intrinsic(b.module, "llvm.x86.avx512.mask.reduce.ps.512", ty,
                       [ty, i32, ty, i16t, i32])
    # imm 9: keep 0 fraction bits, round down, no precision exception; rounding: current
    frac = b.call(reduce, [t, const(i32, 9), t, ir.Constant(i16t, -1), const(i32, 4)])
    p = vmath.fma(b, vmath.horner(b, EXP2_P4, frac), frac, vmath.splat(ty, 1.0))
    scalef = intrinsic(b.module, "llvm.x86.avx512.mask.scalef.ps.512", ty,
                       [ty, ty, ty, i16t, i32])
    return b.call(scalef, [p, t, p, ir.Constant(i16t, -1), const(i32, 4)])


def pair_rows_padded(e: int, L: int) -> int:
    """Word rows per K panel: ``ceil(e/2)`` rounded up to whole vectors."""
    return _cdiv(_cdiv(e, 2), L) * L


def emit_pack_v_pairs(module: ir.Module, L: int, ev: int, ev_pad: int, ld: int,
                      lk: int | None) -> ir.Function:
    """``void pack_v_pairs(ptr src, ptr dst)``: V (``lk`` x ``ev`` bf16, row stride ``ld``) into
    ``ceil(lk/2)`` rows of ``ev_pad`` words, ``dst[j][c] = (V[2j][c], V[2j+1][c])``, zero past
    ``ev``; an odd ``lk`` gets a zero high half in its last row. ``lk`` None: a third argument
    ``i64 lk`` (the generic kernel)."""
    name = f"pack_v_pairs.{L}.{ev}.{ev_pad}.{ld}.{lk or 'n'}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, ptr] + [i64] * (lk is None), ["src", "dst", "lk"])
    f.fn.attributes.add("noinline")
    src, dst = f.args[:2]
    b = f.b
    if lk is None:
        n = f.args[2]
        pairs = b.sdiv(n, const(i64, 2))
        odd = b.icmp_signed("!=", b.srem(n, const(i64, 2)), const(i64, 0))
    else:
        pairs, odd = lk // 2, lk % 2
    if lk is None or lk >= 2:
        pack = emit_pack_cols(module, ev_pad, ld, L, pairs=True)
        b.call(pack, [src, const(i64, ev), f.i64(pairs), dst])
    if lk is None or odd:
        wt = ir.VectorType(i32, L)
        with f.if_(odd) if lk is None else nullcontext():
            for c in range(0, ev_pad, L):  # the last row, V[2 pairs]
                x = _load_i16(b, src, f.i64(iadd(b, imul(b, pairs, 2 * ld), c)), L,
                              simd.const_mask(L, ev - c))
                idx = f.i64(iadd(b, imul(b, pairs, ev_pad), c))
                b.store(b.zext(x, wt), simd.gep(b, dst, idx, i32), align=4)
    return f.finish()


__all__ = ["emit_pack_k_pairs", "emit_pack_v_pairs", "emit_pair_rows", "emit_widen",
           "exp2_p", "pair_rows_padded", "splat_bit", "store_p"]
