"""The fused top-k's screening: the bounds of how far an approximate score (bf16 products, or
int8 weights on ``vpdpbusd``) may lie from the float32 one, so a lane whose approximation cannot
beat the heap root moved by that bound is dropped without rescoring (fused_topk.py's module
doc); and on matrix tiles, the screen of a stored block of scores run beside the next block's
products (``PendingScreen``)."""
from __future__ import annotations

from llvmlite import ir

from . import simd, vmath
from .gemm_bf16 import bound_factor
from .gemm_tile import STEP, StepSlices
from .irutil import const, f32, i1, i32, i64, ptr, smin


class ScreenBounds:
    """Mixin of fused_topk's emitter (``self.s``, ``self.f``, ``self.L``, ``self.bf16``,
    ``self.int8``): the per-row root it screens against and the per-lane bounds."""

    def update_screen_root(self, b, i, hv, cnt, roots, qn, e_max):
        """roots[i] = row i's heap root moved by the widest bound of the row, rounded outward
        (a lane whose approximation does not pass it cannot pass its own bound: see
        ``screen_lanes``), once the heap is full, else NaN (every lane passes). An infinite or
        NaN bound makes the moved root NaN: every lane passes. ``e_max``: [max e_j] (bf16), or
        [max E1_j, max E2_j] (int8; ``qn`` points at the row's (t, alpha, beta, ..))."""
        full = b.icmp_signed("==", simd.load_scalar(b, cnt, i, i64), const(i64, self.s.k))
        root = simd.load_scalar(b, hv, b.mul(i, const(i64, self.s.k)))
        fc = lambda v: ir.Constant(f32, v)  # noqa: E731
        if self.int8:  # alpha max E1 + beta max E2 + slack (screen_lanes's e_j for any j)
            alpha, beta = (simd.load_scalar(b, qn, const(i64, j)) for j in (1, 2))
            margin = b.fadd(b.fadd(b.fmul(e_max[0], alpha), b.fmul(e_max[1], beta)),
                            fc((self.s.k_dim + 64) * 2.0 ** -122))
        else:
            c1, c2 = _denormal_slack(self.s.k_dim)
            margin = b.fadd(b.fmul(e_max[0], b.fadd(qn, fc(c1))),
                            b.fmul(b.fadd(qn, fc(1.0)), fc(c2)))
        # each rounding above and below is within 2^-24 of its result: widen by 2^-20 of
        # |root| + margin (and 2^-100 for zeros and denormals) so the moved root errs outward
        slack = b.fadd(b.fmul(b.fadd(self.f.call_intrinsic("llvm.fabs.f32", f32, [root]),
                                     margin), fc(2.0 ** -20)),
                       fc(2.0 ** -100))
        widened = b.fadd(margin, slack)
        moved = b.fsub(root, widened) if self.s.largest else b.fadd(root, widened)
        simd.store_scalar(b, b.select(full, moved, ir.Constant(f32, float("nan"))), roots, i)

    def screen_setup(self, b, qn):
        """Per-row broadcasts of the screening bound. int8: ``qn`` points at the row's (t,
        alpha, beta, 128 sum q8) (emit_pack_int8); bf16: ``qn`` is |x_row| rounded up."""
        L, kd = self.L, self.s.k_dim
        if self.int8:
            t_v, al_v, be_v = (simd.broadcast(b, simd.load_scalar(b, qn, const(i64, j)), L)
                               for j in range(3))
            c_v = simd.broadcast(b, simd.load_scalar(b, qn, const(i64, 3), i32), L)
            slack_v = simd.broadcast(b, ir.Constant(f32, (kd + 64) * 2.0 ** -122), L)
            return t_v, al_v, be_v, c_v, slack_v
        c1, c2 = _denormal_slack(kd)
        return (simd.broadcast(b, b.fadd(qn, ir.Constant(f32, c1)), L),
                simd.broadcast(b, b.fmul(b.fadd(qn, ir.Constant(f32, 1.0)),
                                         ir.Constant(f32, c2)), L))

    def screen_lanes(self, b, setup, row, ev, col0, v, live):
        """(approx score, its bound e) of 16 tile lanes from column ``col0 + 16 v``:
        |float32 score - approx| <= e. bf16: the tile holds the approximations and
        e = e_j |q| + slack. int8: the tile holds sum_i (w8_ij + 128) q8_i; less 128 sum_i
        q8_i that is D = q8 . w8, exact in float32 (|D| <= K 127^2 < 2^24), approx = D s_j t
        = q^ . w^, and with ``ev`` (s_j, E1_j, E2_j) by column, e = alpha E1_j + beta E2_j +
        slack (see ``emit_pack_int8``)."""
        L, n = self.L, self.s.n
        col = b.add(col0, const(i64, v * L))
        if self.bf16:
            qn_v, slack_v = setup
            return (simd.load_vec(b, row, const(i64, v * L), L),
                    vmath.fma(b, simd.masked_load(b, ev, col, live, L), qn_v, slack_v))
        t_v, al_v, be_v, c_v, slack_v = setup
        acc = b.load(simd.gep(b, row, const(i64, v * L), i32), typ=ir.VectorType(i32, L),
                      align=4)
        d = b.sitofp(b.sub(acc, c_v), simd.vty(L))
        sj, e1, e2 = (simd.masked_load(b, ev, b.add(col, const(i64, j * n)), live, L)
                      for j in range(3))
        approx = b.fmul(b.fmul(d, sj), t_v)
        e = b.fadd(vmath.fma(b, e1, al_v, b.fmul(e2, be_v)), slack_v)
        return approx, e


def _denormal_slack(kd: int) -> tuple[float, float]:
    """(C1, C2) of the bf16 screen's bound: denormals (flushed by vdpbf16ps) add at most
    2^-126 K (|w| + |q| + 1); with e_j = c |w_j| that is e_j * C1 + (|q| + 1) * C2."""
    return 2.0 ** -126 * kd / bound_factor(kd), 2.0 ** -126 * kd * 1.01


class PendingScreen(StepSlices):
    """The screen of the last block of scores on the tiles, run in slices of rows between the
    tile products of the next block (``block_product``'s ``side``), then the filter of its rows
    that may enter their heaps. The vector screen then overlaps the tile unit's work, where it
    waited for the block's products and they for it: tile registers are not renamed, so the
    next block's products could not start before the last one's scores were stored (Intel
    Xeon with AMX, 2 threads, 20000 x 128, k = 10, float32, alternating processes: 32 rows
    234-256 -> 208-215 us, 77 rows 520-561 -> 472-492; prefetching the float32 rows of the
    lanes that pass, to be rescored, measured no faster). Blocks alternate between two
    buffers; each block is filtered before the next one is screened, so every screen reads the
    roots its sequential form read, and heaps see columns in order.

    A block's scores (bf16), or their approximations (float32 with a bf16 screen; with the int8
    one, computed from its sums as ``screen_lanes`` does), are compared with each row's stale
    root (screen: less the row's widest bound): only rows with a lane that may enter their heap
    are filtered (gemm_micro.py's register screen, stored)."""

    def __init__(self, e, roots, filter_block, int8=None):
        self.e, self.f, self.roots, self.filter_block = e, e.f, roots, filter_block
        # int8 sums: (the rows' quantisation data, the thread's first row, the columns' data)
        self.int8 = int8
        f, mr = self.f, e.s.mr
        # block rows per tile step: the rows spread over a product's steps
        self.per_step, self.block_rows = -(-mr // (e.kwa // STEP)), mr
        self.on = f.var(i1, const(i1, 0), "scr.on")
        self.parity = f.var(i64, const(i64, 0), "scr.par")
        self.hit = f.var(i64, const(i64, 0), "scr.hit")
        self.block = f.var(ptr, ir.Constant(ptr, None), "scr.block")
        self.q = f.var(i64, const(i64, 0), "scr.q")
        self.row_t = f.var(i64, const(i64, 0), "scr.row")
        self.rows = f.var(i64, const(i64, 0), "scr.rows")
        self.cols = f.var(i64, const(i64, 0), "scr.cols")

    def next_block(self, tiles) -> ir.Value:
        """The buffer the next block's scores go to: not the pending block's."""
        b, s = self.f.b, self.e.s
        block = simd.gep(b, tiles, b.mul(self.parity.get(), const(i64, s.mr * s.nr)))
        self.parity.set(b.xor(self.parity.get(), const(i64, 1)))
        return block

    def set(self, block, q, row_t, rows, cols) -> None:
        """A block just stored is pending."""
        for var, v in ((self.block, block), (self.q, q), (self.row_t, row_t), (self.rows, rows),
                       (self.cols, cols), (self.hit, const(i64, 0))):
            var.set(v)
        self.on.set(const(i1, 1))

    def run(self, r0, r1) -> None:
        """Screen the pending block's rows [r0, r1) (clipped to its rows) into its hit bits."""
        f, e = self.f, self.e
        b = f.b
        op = ">" if e.s.largest else "<"
        with f.if_(self.on.get()):
            block, roots = self.block.get(), simd.gep(b, self.roots, self.row_t.get())
            mask = simd.lane_mask(b, 32, self.cols.get())
            if self.int8:
                qinfo, row0, evec = self.int8
                sj = simd.masked_load(b, evec, b.mul(self.q.get(), const(i64, e.s.nr)), mask, 32)
            with f.for_range(r0, smin(b, r1, self.rows.get()), name="sr") as r:
                if self.int8:  # the approximations screen_lanes computes, 32 lanes at once
                    info = simd.gep(b, qinfo, b.mul(b.sub(b.add(self.row_t.get(), r), row0),
                                                    const(i64, 4)))
                    acc = b.load(simd.gep(b, block, b.mul(r, const(i64, 32)), i32),
                                 typ=ir.VectorType(i32, 32), align=4)
                    c = simd.broadcast(b, simd.load_scalar(b, info, const(i64, 3), i32), 32)
                    t = simd.broadcast(b, simd.load_scalar(b, info, const(i64, 0)), 32)
                    row = b.fmul(b.fmul(b.sitofp(b.sub(acc, c), simd.vty(32)), sj), t)
                else:
                    row = simd.load_vec(b, block, b.mul(r, const(i64, 32)), 32)
                root = simd.broadcast(b, simd.load_scalar(b, roots, r), 32)
                lanes = b.and_(b.fcmp_unordered(op, row, root), mask)
                any_ = b.icmp_unsigned("!=", b.bitcast(lanes, ir.IntType(32)),
                                       ir.Constant(ir.IntType(32), 0))
                self.hit.set(b.or_(self.hit.get(), b.shl(b.zext(any_, i64), r)))

    def filter(self) -> None:
        """Filter the pending block's rows that hit (it was screened whole), then none is."""
        f = self.f
        b = f.b
        with f.if_(b.and_(self.on.get(), nonzero(b, self.hit.get())), likely=False):
            self.filter_block(self.block.get(), self.q.get(), self.row_t.get(), self.rows.get(),
                              self.cols.get(), self.hit.get())
        self.on.set(const(i1, 0))


def nonzero(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    return b.icmp_unsigned("!=", x, const(i64, 0))
