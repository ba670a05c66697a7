"""The online softmax of the attention kernel (attention.py), one block of scores at a time.

Per query row and block of keys: scale and mask the scores, the block's max, the running max
``m`` and sum ``l`` (in log2 units), ``P = 2**(x * c - m)`` written back over the scores (as bf16
pairs when the P V product takes them), and the output accumulator rescaled when the max moves;
at the end of a row's keys ``finish_rows`` divides by ``l`` (0 for a row with no visible key).
A mixin of ``attention._Emitter``: it reads the emitter's spec, function, lanes and buffers.
"""
from __future__ import annotations

import math

from llvmlite import ir

from . import bf16, simd, vmath
from .attention_bf16 import exp2_p, store_p
from .irutil import const, f32, i1, i8, i32, i64, intrinsic, ptr

NEG_INF = -math.inf
# the lowest finite fill value kept: scores are scaled by log2(e) after masking, and a fill of
# float32's min (transformers' masks) would overflow to -inf there, turning the uniform softmax
# of a fully masked row into NaN; a fill this low still gives p = 0 next to any real score
FILL_MIN = -2.3e38


class SoftmaxRows:
    def softmax(self, head, i0, rows, j0, kv, sbuf, obuf, mrow, lrow):
        """Running max ``m`` and sum ``l`` are kept in log2 units: ``p = 2**(x*c - m)`` with
        ``c = scale * log2(e)`` is one FMA and a short exp2. Without a mask the first pass only
        reads (max of raw scores); with one it stores the masked, scaled scores."""
        s, L, f = self.s, self.L, self.f
        b = f.b
        vt = simd.vty(L)
        c = self.scale * 1.4426950408889634
        raw = s.mask == "none" and c > 0  # max(x) * c == max(x * c)
        ninf = vmath.splat(vt, NEG_INF)
        with f.for_range(0, rows, name="sr") as r:
            i = b.add(i0, r)
            row = simd.gep(b, sbuf, b.mul(r, const(i64, self.ld_s)))
            if not s.causal:
                full = b.mul(b.sdiv(kv, const(i64, L)), const(i64, L))
                tail, live_of = b.sub(kv, full), None
            else:  # keys j0 + col <= i are visible
                # Every row runs over the block's keys (one loop count for all its rows; a count
                # per row mispredicted the loop exits on most rows: (8,8,128,32) bf16 ran 1.5x
                # slower causal than not); keys past the row's diagonal load as -inf, so p = 0.
                full = b.mul(b.sdiv(b.add(kv, const(i64, L - 1)), const(i64, L)),
                             const(i64, L))
                tail = const(i64, 0)
                vis = b.add(b.sub(i, j0), const(i64, 1))    # and none past the block's keys
                vis = b.trunc(b.select(b.icmp_signed("<", vis, kv), vis, kv), i32)
                ids = ir.Constant(ir.VectorType(i32, L), list(range(L)))

                def live_of(col):
                    return b.icmp_signed("<", ids, simd.broadcast(
                        b, b.sub(vis, b.trunc(col, i32)), L))
            mx = [f.var(vt, ninf, "mx") for _ in range(self.chains)]

            def pass1(col, x, live, ch=0):
                if not raw:
                    x = b.fmul(x, vmath.splat(vt, self.scale))
                    x = self.apply_mask(head, i, b.add(j0, col), x, live, L)
                    x = b.fmul(x, vmath.splat(vt, 1.4426950408889634))
                    simd.store_vec(b, x, row, col)
                mx[ch].set(_vmax(b, mx[ch].get(), x))

            def load1(col):
                if live_of is None:
                    return simd.load_vec(b, row, col, L), simd.const_mask(L, L)
                live = live_of(col)
                return simd.masked_load(b, row, col, live, L, passthru=NEG_INF), live

            self.vectors(full, "c1", lambda col, ch: pass1(col, *load1(col), ch))
            with f.if_(b.icmp_signed(">", tail, const(i64, 0))):
                live = simd.lane_mask(b, L, tail)
                x = simd.masked_load(b, row, full, live, L, passthru=NEG_INF)
                pass1(full, x, live)
                # masked-out lanes of the tail vector stay -inf
            blk = simd.hmax(b, _combine(lambda x, y: _vmax(b, x, y), [v.get() for v in mx]))
            if raw:
                blk = b.fmul(blk, ir.Constant(f32, c))
            m_old = simd.load_scalar(b, mrow, r)
            m_new = _smax(b, m_old, blk)
            ref = b.select(b.fcmp_ordered("==", m_new, ir.Constant(f32, NEG_INF)),
                           ir.Constant(f32, 0.0), m_new)
            refv = simd.broadcast(b, ref, L)
            acc = [f.var(vt, vmath.splat(vt, 0.0), "sum") for _ in range(self.chains)]

            def pass2(col, x, ch=0):
                t = vmath.fma(b, x, vmath.splat(vt, c), b.fsub(vmath.splat(vt, 0.0), refv)) \
                    if raw else b.fsub(x, refv)
                p = exp2_p(b, t) if self.pv_pairs else vmath.exp2_softmax(b, t, self.avx512)
                if self.pv_pairs:  # bf16 P over the row's first half (read already), as pairs
                    store_p(b, p, row, col)
                else:
                    simd.store_vec(b, p, row, col)
                acc[ch].set(b.fadd(acc[ch].get(), p))

            def load2(col):  # without a mask pass 1 stored nothing: the same loads again
                if live_of is None or not raw:
                    return simd.load_vec(b, row, col, L)
                return simd.masked_load(b, row, col, live_of(col), L, passthru=NEG_INF)

            self.vectors(full, "c2", lambda col, ch: pass2(col, load2(col), ch))
            with f.if_(b.icmp_signed(">", tail, const(i64, 0))):
                x = simd.masked_load(b, row, full, simd.lane_mask(b, L, tail), L,
                                     passthru=NEG_INF)
                if not raw:  # the tail's invisible lanes were never stored as -inf
                    x = b.select(simd.lane_mask(b, L, tail), x, ninf)
                pass2(full, x)
            l_old = simd.load_scalar(b, lrow, r)
            alpha = vmath.exp2_softmax(b, b.fsub(m_old, ref), False)
            total = simd.hsum(b, _combine(b.fadd, [v.get() for v in acc]))
            simd.store_scalar(b, vmath.fma(b, l_old, alpha, total), lrow, r)
            simd.store_scalar(b, m_new, mrow, r)
            # the first block writes O (FIRST mode), later ones rescale it when the max moved
            moved = b.and_(b.icmp_signed("!=", j0, const(i64, 0)),
                           b.fcmp_ordered("!=", alpha, ir.Constant(f32, 1.0)))
            with f.if_(moved):
                av = simd.broadcast(b, alpha, L)
                orow = b.mul(r, const(i64, self.ev_pad))
                with f.for_range(0, self.ev_pad, step=L, name="oc") as col:
                    idx = b.add(orow, col)
                    simd.store_vec(b, b.fmul(simd.load_vec(b, obuf, idx, L), av), obuf, idx)

    def vectors(self, full, name: str, body) -> None:
        """``body(col, chain)`` for the whole vectors ``col`` < ``full`` of a score row, in
        order; with ``chains`` > 1, that many vectors per iteration, each on its own
        accumulator (the row's max and sum are dependency chains otherwise)."""
        f, b, L, n = self.f, self.f.b, self.L, self.chains
        if n == 1:
            with f.for_range(0, full, step=L, name=name) as col:
                body(col, 0)
            return
        main = b.mul(b.sdiv(full, const(i64, n * L)), const(i64, n * L))
        with f.for_range(0, main, step=n * L, name=name) as col:
            for ch in range(n):
                body(b.add(col, const(i64, ch * L)), ch)
        with f.for_range(main, full, step=L, name=name + "t") as col:
            body(col, 0)

    def apply_mask(self, head, i, j, x, live, L):
        """Add the float mask / apply the bool mask at (head, row i, keys j..j+L)."""
        s, b = self.s, self.f.b
        if s.mask == "none":
            return x
        mb, mh, mq, mk = s.mask_shape
        bi = b.sdiv(head, const(i64, s.heads))
        hi = b.srem(head, const(i64, s.heads))
        off = const(i64, 0)
        for idx, size, stride in zip((bi, hi, i), (mb, mh, mq), self.d.ms):
            if size != 1:  # (generic: 0 = full size)
                off = b.add(off, b.mul(idx, self.f.i64(stride)))
        if s.mask == "float":  # in the q dtype
            if mk == 1:
                m0 = simd.load_scalar(b, self.mask_all, off, self.et)
                mval = simd.broadcast(b, bf16.widen_scalar(b, m0) if self.bf else m0, L)
            elif self.bf:
                mval = bf16.load(b, self.mask_all, b.add(off, j), L, mask=live)
            else:
                mval = simd.masked_load(b, self.mask_all, b.add(off, j), live, L)
            return b.fadd(x, mval)
        # bool mask: one byte per element, True keeps the score ("fill": True masks it)
        keeps = "==" if s.mask == "fill" else "!="
        if mk == 1:
            keep_s = b.icmp_unsigned(keeps, simd.load_scalar(b, self.mask_all, off, i8),
                                     const(i8, 0))
            keep = b.insert_element(ir.Constant(ir.VectorType(i1, L), ir.Undefined), keep_s,
                                    const(i32, 0))
            keep = b.shuffle_vector(keep, ir.Constant(ir.VectorType(i1, L), ir.Undefined),
                                    ir.Constant(ir.VectorType(i32, L), [0] * L))
        else:
            vt8 = ir.VectorType(i8, L)
            fn = intrinsic(b.module, f"llvm.masked.load.v{L}i8.p0", vt8,
                           [ptr, i32, live.type, vt8])
            bytes_ = b.call(fn, [simd.gep(b, self.mask_all, b.add(off, j), i8), const(i32, 1),
                                 live, ir.Constant(vt8, [0] * L)])
            keep = b.icmp_unsigned(keeps, bytes_, ir.Constant(vt8, [0] * L))
        fill = NEG_INF if s.mask != "fill" or s.fill == NEG_INF else max(s.fill, FILL_MIN)
        return b.select(keep, x, vmath.splat(x.type, fill))

    def finish_rows(self, head, i0, rows, obuf, lrow, o_all):
        s, L, f = self.s, self.L, self.f
        b = f.b
        os = self.d.os
        oh = simd.gep(b, o_all, b.add(self.head_off(head, os), b.mul(i0, f.i64(os[2]))), self.et)
        with f.for_range(0, rows, name="fr") as r:
            lsum = simd.load_scalar(b, lrow, r)
            inv = b.fdiv(ir.Constant(f32, 1.0), lsum)
            # no finite score: 0 as ATen's SDPA, or NaN as a written softmax (exp(-inf + inf))
            inv = b.select(b.fcmp_ordered(">", lsum, ir.Constant(f32, 0.0)), inv,
                           ir.Constant(f32, float("nan") if s.empty_nan else 0.0))
            iv = simd.broadcast(b, inv, L)
            for v in range(self.ev_pad // L):
                x = simd.load_vec(b, obuf, b.add(b.mul(r, const(i64, self.ev_pad)),
                                                 const(i64, v * L)), L)
                active = min(L, s.ev - v * L)
                bf16.store_as(b, self.dt, b.fmul(x, iv), oh,
                              b.add(b.mul(r, f.i64(os[2])), const(i64, v * L)), active,
                              native=self.dot)



def _combine(op, values: list):
    """Pairwise ``op`` of the chains' accumulators (one value: itself)."""
    while len(values) > 1:
        values = [op(values[k], values[k + 1]) if k + 1 < len(values) else values[k]
                  for k in range(0, len(values), 2)]
    return values[0]


def _vmax(b, x, y):
    return b.select(b.fcmp_ordered(">", x, y), x, y)


def _smax(b, x, y):
    return b.select(b.fcmp_ordered(">", x, y), x, y)
