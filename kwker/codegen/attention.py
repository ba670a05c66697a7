"""Scaled dot-product attention, flash style: Q blocks x K/V blocks with an online softmax.

Contract: ``out[b,h] = softmax(scale * Q K^T + mask) V`` for float32 or bfloat16 (B, H, L, E)
tensors whose last dim is contiguous (batch, head and row strides are compile-time, contiguous by
default, or read at call time with the sizes: the generic kernel, attention_args.py); ``mask``
is a float mask (added, in the q dtype) or a bool mask (False = -inf), broadcast from its own
4-D shape; ``causal`` masks key j > query i (top-left aligned, as torch does). Rows with no
visible key give 0, as torch does. Grouped-query attention: K and V have
``kv_heads`` heads and query head h reads kv head ``h // (heads // kv_heads)`` (the head offset
comes from the strides, nothing is copied).

bfloat16: the softmax runs in float32 and the output is rounded once (round to nearest even,
as ATen). The products, on CPUs with AVX512_BF16: ``vdpbf16ps`` on bf16 pairs, float32 sums
(attention_bf16.py has the layouts): S = Q K^T on Q rows and K panels of pairs along e; O += P V
on P rounded to bf16 (as ATen's flash kernel rounds it) and V packed in key pairs, when e == ev.
When e != ev ATen computes in float32 (its flash kernel wants equal head sizes), so P stays
float32 and V is widened, as everywhere on other CPUs: K and V widened once per kv head per
thread into float32 scratch (K then packed as below, V read from there as the B operand,
zero-padded to whole vectors), the rows of a Q block once per block, float32 FMAs. The
few-query path reads Q and K in place with widening loads.

Per work item (one head, one block of ``bq`` query rows) and per block of ``bk`` keys:
1. ``S = Q_blk K_blk^T`` with the GEMM micro-kernel: Q rows broadcast straight from Q, K packed
   once per head per thread into ``nr``-key panels (k-major, so keys are the vector lanes).
2. For every row (attention_softmax.py): scale, mask, block max, running max ``m``,
   ``P = exp(S - m)`` (vectorised exp from vmath), running sum ``l``; the row of the output
   accumulator is rescaled by ``exp(m_old - m_new)`` when the max moves.
3. ``O_acc += P V_blk`` with the micro-kernel again (P broadcast from the S buffer, V rows read
   in place as the B operand).
Causal blocks entirely above the diagonal are skipped; only the diagonal block is masked per
element. Work items are dealt round-robin over threads (causal items have unequal costs), heads
and batch included, so one head still uses all threads. No fast-math: explicit FMAs only.
"""
from __future__ import annotations

import math

from llvmlite import ir

from . import bf16, omp, simd, vmath
from .attention_args import (
    DIRECT_MAX_LQ,
    align64,
    emit_copy_rows,
    emit_generic,
    icdiv,
    imul,
    kv_bytes_per_key,
    load_dims,
    round_up,
    scratch,
    static_dims,
    thread_cap,
    thread_items,
)
from .attention_bf16 import (
    emit_pack_k_pairs,
    emit_pack_v_pairs,
    emit_pair_rows,
    emit_widen,
    pair_rows_padded,
    splat_bit,
)
from .attention_softmax import NEG_INF, SoftmaxRows
from .attention_tile import TileProducts
from .gemm_micro import FIRST, LAST, Micro, emit_micro
from .gemm_pack import emit_pack_rows
from .irutil import Fn, const, f32, i16, i32, i64, intrinsic, new_module, ptr


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def emit(spec, target) -> ir.Module:
    L = simd.float_lanes(target)
    module = new_module(spec.symbol)
    dpbf16 = bf16.native(target)
    if spec.path == "tile" and target.tiles not in ("amx", "emulated"):
        raise ValueError(f"kwker attention: the tile path needs a target with tiles, not "
                         f"{target.describe()}")
    if not spec.batch:  # generic: both schedules, sizes and strides at call time
        direct, blocked = (_Emitter(module, spec, L, target.has("avx512f"), dpbf16, d,
                                    target.tiles).body() for d in (True, False))
        emit_generic(module, spec, direct, blocked, DIRECT_MAX_LQ)
        return module
    body = _Emitter(module, spec, L, target.has("avx512f"), dpbf16, tiles=target.tiles).body()
    flops = 4 * spec.batch * spec.heads * spec.lq * spec.lk * max(spec.e, spec.ev)
    items = spec.batch * spec.heads * _cdiv(spec.lq, spec.bq)
    kv_bytes = spec.batch * spec.lk * kv_bytes_per_key(spec)
    max_threads = max(1, min(items, thread_cap(flops, kv_bytes)))
    omp.emit_parallel(module, spec.symbol, [ptr] * 5, body, max_threads=max_threads)
    return module


class _Emitter(SoftmaxRows):
    def __init__(self, module, spec, lanes, avx512: bool, dpbf16: bool = False,
                 direct: bool | None = None, tiles: str = ""):
        self.m, self.s, self.L, self.avx512 = module, spec, lanes, avx512
        s = spec
        # generic (attention_args.py): sizes and strides (``self.d``) are read in body()
        self.gen = not s.batch
        self.bk = s.bk if self.gen else min(s.bk, _cdiv(s.lk, s.nr) * s.nr)
        # row stride of the scores (and of P over their rows' first halves), in floats: a
        # multiple of 256 (1 KB) is padded by a line, or the 16 rows a tile stores or loads
        # would share a few L1 sets
        self.ld_s = self.bk + 16 if self.bk % 256 == 0 else self.bk
        self.scale = s.scale if s.scale else 1.0 / math.sqrt(s.e)
        self.ev_pad = _cdiv(s.ev, lanes) * lanes
        # a few queries (decode): scores as dot products with K in place, no K packing
        self.direct = s.lq <= DIRECT_MAX_LQ if direct is None else direct
        self.kvh = s.kv_heads or s.heads
        self.d = None if self.gen else static_dims(s, self.kvh)
        # row strides of q, k, v as the packing helpers and micro-kernels see them: compile-time,
        # so the generic kernel copies operands with other row strides into scratch first
        self.q_row, self.k_row, self.v_row = (s.e, s.e, s.ev) if self.gen else \
            (self.d.qs[2], self.d.ks[2], self.d.vs[2])
        # element type of q/k/v/mask/out in memory; bf16 operands of the micro-kernels are
        # widened into float32 scratch first, whose row strides these are
        self.dt = s.dtype
        self.bf = s.dtype == "bf16"
        self.et = i16 if self.bf else f32
        self.q_ld = s.e if self.bf and not self.direct else self.q_row
        self.v_ld = self.ev_pad if self.bf else self.v_row
        # bf16 with vdpbf16ps (module doc): S from Q rows of ``ep`` words and K panels of
        # ``ep_pad`` word rows; O from P rounded over its own S row and V in key pairs
        self.dot = self.bf and dpbf16
        self.qk_pairs = self.dot and not self.direct
        self.pv_pairs = self.dot and s.e == s.ev
        if self.qk_pairs:
            self.ep, self.ep_pad = _cdiv(s.e, 2), pair_rows_padded(s.e, lanes)
            self.q_ld = self.ep
        # softmax (bf16 on AVX512_BF16): independent max/sum accumulators per score row, and a
        # shorter exp2 for the P that is rounded; float32 and the other ISAs keep their code
        self.chains = 4 if self.dot else 1
        # both products on matrix tiles (attention_tile.py), set up in body(); their Q pair
        # rows are K's panel rows long (whole tile steps, zero past e)
        self.tile_mode = tiles if s.path == "tile" and not self.direct else ""
        self.tile = None
        if self.tile_mode and self.qk_pairs:
            self.q_ld = self.ep_pad

    def head_off(self, head, strides, heads: int | None = None):
        """Element offset of head ``head`` (= batch * heads + h) for these strides."""
        b, H = self.f.b, const(i64, heads or self.s.heads)
        return b.add(b.mul(b.sdiv(head, H), self.f.i64(strides[0])),
                     b.mul(b.srem(head, H), self.f.i64(strides[1])))

    def kv_index(self, head):
        """batch * kv_heads + the kv head that query head ``head`` reads."""
        s, b = self.s, self.f.b
        if self.kvh == s.heads:
            return head
        H = const(i64, s.heads)
        return b.add(b.mul(b.sdiv(head, H), const(i64, self.kvh)),
                     b.sdiv(b.srem(head, H), const(i64, s.heads // self.kvh)))

    # -- micro-kernel variants --------------------------------------------------------------
    def s_kernel(self, rows: int, cols: int) -> ir.Function:
        s, L = self.s, self.L
        if self.qk_pairs:  # float32 S (FIRST only: never the bf16 store of the LAST block)
            return emit_micro(self.m, Micro(rows, _cdiv(cols, L), L, cols, self.q_ld, 1, s.nr,
                                            False, self.ld_s, dot="dpbf16", ldo=self.ld_s))
        return emit_micro(self.m, Micro(rows, _cdiv(cols, L), L, cols, self.q_ld, 1, s.nr,
                                        False, self.ld_s))

    def o_kernel(self, rows: int) -> ir.Function:
        s, L = self.s, self.L
        if self.pv_pairs:  # A: the P pairs over each S row (bk words apart); B: V key pairs
            return emit_micro(self.m, Micro(rows, self.ev_pad // L, L, s.ev, self.ld_s, 1,
                                            self.ev_pad, False, self.ev_pad, dot="dpbf16",
                                            ldo=self.ev_pad))
        return emit_micro(self.m, Micro(rows, self.ev_pad // L, L, s.ev, self.ld_s, 1, self.v_ld,
                                        not self.bf and s.ev % L != 0, self.ev_pad))

    def o_panels(self) -> range:
        """First columns of the output product's column panels: as many vectors a panel as
        ``mro`` rows of accumulators leave room for beside a B row and a broadcast (AVX2: 6 x 2
        vectors; a whole row of ev 64, 8 vectors, left room for one row of accumulators, so
        every FMA waited on a load: (1, 16, 1024, 64) 38 -> 27.5 ms on Zen 3, ATen 30.8, causal
        20.8 -> 15.2; AVX-512 keeps one panel)."""
        regs = 32 if self.avx512 else 16
        nv = max(1, min(self.ev_pad // self.L, (regs - 2) // (self.s.mro + 1)))
        return range(0, self.ev_pad, nv * self.L)

    def o_panel(self, rows: int, c0: int) -> ir.Function:
        s, L = self.s, self.L
        width = self.o_panels().step
        cols = min(width, s.ev - c0)
        return emit_micro(self.m, Micro(rows, _cdiv(cols, L), L, cols, self.ld_s, 1, self.v_ld,
                                        not self.bf and cols % L != 0, self.ev_pad))

    def body(self) -> ir.Function:
        s = self.s
        f = omp.body_fn(self.m, f"{s.symbol}.body" + ((".direct" if self.direct else ".blocked")
                                                      if self.gen else ""))
        self.f = f
        if self.tile_mode:
            self.tile = TileProducts(self, self.tile_mode)
        b = f.b
        ctx = omp.Context(f, f.args[0])
        tid, nt = f.args[1], f.args[2]
        q_all, k_all, v_all, mask_all, o_all = (ctx.ptr(i) for i in range(5))
        self.mask_all = mask_all
        if self.gen:
            self.d = load_dims(f, ctx, s)
        d = self.d

        malloc = intrinsic(self.m, "malloc", ptr, [i64])
        free = intrinsic(self.m, "free", ir.VoidType(), [ptr])
        blocked = not self.direct
        kp_floats = imul(b, blocked, round_up(b, d.lk, s.nr),
                         self.ep_pad if self.qk_pairs else s.e)
        sizes = [kp_floats, s.bq * self.ld_s, s.bq * self.ev_pad, s.bq, s.bq]
        if self.bf:  # V of one kv head: key pairs (words) or float32
            sizes.append(imul(b, icdiv(b, d.lk, 2), self.ev_pad) if self.pv_pairs else
                         imul(b, d.lk, self.ev_pad))
        if self.qk_pairs:  # Q pairs of one block
            sizes += [0, s.bq * self.q_ld]
        elif self.bf:  # float32 K of one kv head and one Q block (blocked path)
            sizes += [imul(b, d.lk, s.e, blocked), s.bq * s.e * blocked]
        if self.gen:  # copies of K (blocked path), V and a Q block whose rows are strided
            strided = [b.icmp_signed("!=", st, const(i64, n))
                       for st, n in ((d.ks[2], s.e), (d.vs[2], s.ev))]
            sizes += [b.select(st, imul(b, d.lk, n), const(i64, 0)) if use else 0
                      for st, n, use in zip(strided, (s.e, s.ev), (blocked, True))]
            sizes.append(s.bq * s.e * blocked)
            raws, parts = scratch(f, malloc, sizes)
        else:
            raws = [b.call(malloc, [const(i64, 4 * n + 64)]) for n in sizes]
            parts = [align64(b, r) for r in raws]
        kp, sbuf, obuf, mrow, lrow, *wide = parts
        if self.gen:
            *wide, kd, vd, self.qd = wide
        vf, kf, self.qf = wide or (None, None, None)
        pack_k = None if self.qk_pairs else \
            emit_pack_rows(self.m, s.nr, s.e if self.bf else self.k_row, self.L)

        begin, end, stride = thread_items(f, imul(b, d.batch, s.heads), d.nqb, tid, nt)
        cur_kv = f.var(i64, const(i64, -1), "kvhead")
        it = f.var(i64, begin, "it")
        with f.while_(lambda: b.icmp_signed("<", it.get(), end)):
            item = it.get()
            head = b.sdiv(item, f.i64(d.nqb))
            qb = b.srem(item, f.i64(d.nqb))
            kv = self.kv_index(head)
            kh = simd.gep(b, k_all, self.head_off(kv, d.ks, self.kvh), self.et)
            vh = simd.gep(b, v_all, self.head_off(kv, d.vs, self.kvh), self.et)
            if self.gen:  # K and V as the helpers below read them: rows e / ev apart
                k_in, v_in = kh, vh
                vh = b.select(strided[1], vd, vh)
                if blocked:
                    kh = b.select(strided[0], kd, kh)
            if self.bf or not self.direct or self.gen:  # once per kv head on this thread
                with f.if_(b.icmp_signed("!=", kv, cur_kv.get())):
                    if self.gen:
                        self.copy_rows(v_in, d.vs[2], s.ev, vd, strided[1])
                        if blocked:
                            self.copy_rows(k_in, d.ks[2], s.e, kd, strided[0])
                    if self.pv_pairs:
                        pack_v = emit_pack_v_pairs(self.m, self.L, s.ev, self.ev_pad, self.v_row,
                                                   None if self.gen else s.lk)
                        b.call(pack_v, [vh, vf] + [d.lk] * self.gen)
                    elif self.bf:
                        widen = emit_widen(self.m, self.L, s.ev, self.v_row, self.ev_pad)
                        b.call(widen, [vh, f.i64(d.lk), vf])
                    if self.qk_pairs:
                        b.call(emit_pack_k_pairs(self.m, self.L, s.nr, s.e, self.k_row),
                               [kh, f.i64(d.lk), kp])
                    elif not self.direct:
                        src = kh
                        if self.bf:
                            widen = emit_widen(self.m, self.L, s.e, self.k_row, s.e)
                            b.call(widen, [kh, f.i64(d.lk), kf])
                            src = kf
                        b.call(pack_k, [src, f.i64(d.lk), const(i64, s.e), kp])
                    cur_kv.set(kv)
            self.block(head, qb, q_all, vf if self.bf else vh, o_all, kh if self.direct else kp,
                       sbuf, obuf, mrow, lrow)
            it.set(b.add(item, stride))
        for r in raws:
            b.call(free, [r])
        return f.finish()

    def copy_rows(self, src, ld, cols: int, dst, strided, rows=None) -> None:
        """If ``strided``: ``rows`` (default lk) rows of ``cols`` elements, ``ld`` apart, into
        ``dst`` ``cols`` apart (the generic kernel's operands for the compile-time helpers)."""
        with self.f.if_(strided):
            fn = emit_copy_rows(self.m, cols, 2 if self.bf else 4)
            self.f.b.call(fn, [src, self.d.lk if rows is None else rows, ld, dst])

    # -- one (head, query block) ------------------------------------------------------------
    def block(self, head, qb, q_all, vh, o_all, kp, sbuf, obuf, mrow, lrow):
        s, f = self.s, self.f
        b = f.b
        i0 = b.mul(qb, const(i64, s.bq))
        i1 = b.add(i0, const(i64, s.bq))
        d = self.d
        i1 = b.select(b.icmp_signed("<", i1, f.i64(d.lq)), i1, f.i64(d.lq))
        rows = b.sub(i1, i0)
        qh = simd.gep(b, q_all, b.add(self.head_off(head, d.qs),
                                      b.mul(i0, f.i64(d.qs[2]))), self.et)
        if self.gen and not self.direct:  # the block's rows e apart, as the helpers read them
            strided = b.icmp_signed("!=", d.qs[2], const(i64, s.e))
            self.copy_rows(qh, d.qs[2], s.e, self.qd, strided, rows)
            qh = b.select(strided, self.qd, qh)
        if self.qk_pairs:  # the block's query rows as pairs, q_ld words each
            b.call(emit_pair_rows(self.m, self.L, s.e, self.q_row, self.q_ld),
                   [qh, rows, self.qf])
            qh = self.qf
        elif self.bf and not self.direct:  # the block's query rows in float32, row stride e
            b.call(emit_widen(self.m, self.L, s.e, self.q_row, s.e), [qh, rows, self.qf])
            qh = self.qf
        with f.for_range(0, s.bq, name="init") as r:
            simd.store_scalar(b, ir.Constant(f32, NEG_INF), mrow, r)
            simd.store_scalar(b, ir.Constant(f32, 0.0), lrow, r)
        kv_end = f.i64(d.lk)
        if s.causal:  # keys up to the block's last row, whole panels (masked per element)
            need = b.mul(b.sdiv(b.add(i1, const(i64, s.nr - 1)), const(i64, s.nr)),
                         const(i64, s.nr))
            kv_end = b.select(b.icmp_signed("<", need, kv_end), need, kv_end)
        with f.for_range(0, kv_end, step=self.bk, name="kv") as j0:
            kv = b.sub(kv_end, j0)
            kv = b.select(b.icmp_signed("<", kv, const(i64, self.bk)), kv, const(i64, self.bk))
            self.scores(qh, kp, sbuf, j0, kv, rows)
            self.softmax(head, i0, rows, j0, kv, sbuf, obuf, mrow, lrow)
            self.accumulate(vh, sbuf, obuf, j0, kv, rows)
        self.finish_rows(head, i0, rows, obuf, lrow, o_all)

    def _row_tiles(self, rows, mr: int, call):
        """``call(r0, nrows_const)`` for full tiles of ``mr`` rows then the edge tile.

        A block has ``bq`` rows except the last one, so only two edge sizes can occur and only
        those micro-kernel variants are emitted. The generic kernel splits the edge into tiles
        of powers of two (a few variants for any lq)."""
        f, b, s = self.f, self.f.b, self.s
        full = b.mul(b.sdiv(rows, const(i64, mr)), const(i64, mr))
        with f.for_range(0, full, step=mr, name="rt") as r0:
            call(r0, mr)
        rest = b.sub(rows, full)
        if self.gen:
            p = 1 << (mr - 1).bit_length() >> 1  # the largest power of two below mr
            while p:
                with f.if_(b.icmp_signed("!=", b.and_(rest, const(i64, p)), const(i64, 0))):
                    call(b.add(full, b.and_(rest, const(i64, -2 * p))), p)
                p //= 2
            return
        last_rows = s.lq - (self.d.nqb - 1) * s.bq
        for extra in sorted({s.bq % mr, last_rows % mr} - {0}):
            with f.if_(b.icmp_signed("==", rest, const(i64, extra))):
                call(full, extra)

    def scores(self, qh, kp, sbuf, j0, kv, rows):
        if self.direct:
            return self.scores_direct(qh, kp, sbuf, j0, kv, rows)
        if self.tile is not None:
            return self.tile.scores(qh, kp, sbuf, j0, kv)
        s, f, L = self.s, self.f, self.L
        b = f.b
        mode = const(i64, FIRST if self.qk_pairs else FIRST | LAST)
        nullp = ir.Constant(ptr, None)
        # K panel words per key and contraction steps: e floats, or ep pairs of ep_pad rows
        kw, kc = (self.ep_pad, self.ep) if self.qk_pairs else (s.e, s.e)
        extra = [nullp] if self.qk_pairs else []

        def tile(r0, nrows):
            a = simd.gep(b, qh, b.mul(r0, const(i64, self.q_ld)))
            c_row = b.mul(r0, const(i64, self.ld_s))
            full_panels = b.sdiv(kv, const(i64, s.nr))
            with f.for_range(0, full_panels, name="sp") as p:
                col = b.mul(p, const(i64, s.nr))
                bp = simd.gep(b, kp, b.mul(b.add(j0, col), const(i64, kw)))
                c = simd.gep(b, sbuf, b.add(c_row, col))
                b.call(self.s_kernel(nrows, s.nr), [a, bp, c, const(i64, kc), mode, nullp,
                                                    nullp] + extra)
            rest = b.srem(kv, const(i64, s.nr))
            col = b.mul(full_panels, const(i64, s.nr))
            bp = simd.gep(b, kp, b.mul(b.add(j0, col), const(i64, kw)))
            c = simd.gep(b, sbuf, b.add(c_row, col))
            # the last panel of the sequence is the only partial one; the generic kernel
            # computes it in whole vectors (K panels are zero past lk)
            if self.gen:
                for w in range(L, s.nr + 1, L):
                    fits = b.and_(b.icmp_signed(">", rest, const(i64, w - L)),
                                  b.icmp_signed("<=", rest, const(i64, w)))
                    with f.if_(fits):
                        b.call(self.s_kernel(nrows, w), [a, bp, c, const(i64, kc), mode,
                                                         nullp, nullp] + extra)
                return
            edge = s.lk % s.nr
            if edge:
                with f.if_(b.icmp_signed(">", rest, const(i64, 0))):
                    b.call(self.s_kernel(nrows, edge), [a, bp, c, const(i64, kc), mode,
                                                        nullp, nullp] + extra)

        self._row_tiles(rows, s.mrs, tile)

    def scores_direct(self, qh, kh, sbuf, j0, kv, rows):
        """S[r, j] = q_r . K_j for L keys at a time: L vector accumulators over E, then one
        transpose-and-add tree puts the L sums into one vector (lane = key)."""
        s, L, f = self.s, self.L, self.f
        b = f.b
        ne = _cdiv(s.e, L)
        zero = vmath.splat(simd.vty(L), 0.0)
        with f.for_range(0, rows, name="dr") as r:
            qrow = simd.gep(b, qh, b.mul(r, f.i64(self.d.qs[2])), self.et)
            qv = [bf16.load_as(b, self.dt, qrow, e * L, L, min(L, s.e - e * L))
                  for e in range(ne)]
            with f.for_range(0, kv, step=L, name="dk") as jb:
                sums = []
                for jj in range(L):
                    key = b.add(b.add(j0, jb), const(i64, jj))
                    live = b.icmp_signed("<", b.add(jb, const(i64, jj)), kv)
                    krow = simd.gep(b, kh, b.mul(key, f.i64(self.d.ks[2])), self.et)
                    acc = zero
                    for e in range(ne):
                        m = b.and_(simd.const_mask(L, min(L, s.e - e * L)),
                                   splat_bit(b, live, L))
                        kv_ = bf16.load(b, krow, e * L, L, mask=m) if self.bf else \
                            simd.masked_load(b, krow, e * L, m, L)
                        acc = vmath.fma(b, qv[e], kv_, acc)
                    sums.append(acc)
                out = transpose_add(b, sums)
                simd.store_vec(b, out, sbuf, b.add(b.mul(r, const(i64, self.ld_s)), jb))

    def accumulate(self, vh, sbuf, obuf, j0, kv, rows):
        if self.tile is not None:
            return self.tile.accumulate(vh, sbuf, obuf, j0, kv, rows)
        s, f = self.s, self.f
        b = f.b
        nullp = ir.Constant(ptr, None)
        extra = [nullp] if self.pv_pairs else []
        if self.pv_pairs:  # key pairs: j0 is even (a multiple of bk), an odd kv ends on a 0 half
            vb = simd.gep(b, vh, b.mul(b.sdiv(j0, const(i64, 2)), const(i64, self.ev_pad)))
            kc = b.sdiv(b.add(kv, const(i64, 1)), const(i64, 2))
        else:
            vb = simd.gep(b, vh, b.mul(j0, const(i64, self.v_ld)))
            kc = kv

        def tile(r0, nrows):
            a = simd.gep(b, sbuf, b.mul(r0, const(i64, self.ld_s)))
            c = simd.gep(b, obuf, b.mul(r0, const(i64, self.ev_pad)))
            mode = b.select(b.icmp_signed("==", j0, const(i64, 0)), const(i64, FIRST),
                            const(i64, 0))
            if self.pv_pairs:
                b.call(self.o_kernel(nrows), [a, vb, c, kc, mode, nullp, nullp] + extra)
                return
            for c0 in self.o_panels():
                b.call(self.o_panel(nrows, c0), [a, simd.gep(b, vb, const(i64, c0)),
                                                 simd.gep(b, c, const(i64, c0)), kc, mode,
                                                 nullp, nullp])

        self._row_tiles(rows, s.mro, tile)


def transpose_add(b: ir.IRBuilder, vecs: list) -> ir.Value:
    """One vector whose lane j is the sum of the lanes of ``vecs[j]`` (n vectors of n lanes):
    log2(n) levels, each adding the two halves of pairs interleaved block-wise."""
    n = len(vecs)
    cur, blk = list(vecs), n // 2
    mask_t = ir.VectorType(i32, n)
    while len(cur) > 1:
        m = len(cur) // 2
        lo_idx, hi_idx = [], []
        for c0 in range(0, n, 2 * blk):
            lo_idx += list(range(c0, c0 + blk)) + [n + x for x in range(c0, c0 + blk)]
            hi_idx += list(range(c0 + blk, c0 + 2 * blk)) + [n + x for x in
                                                              range(c0 + blk, c0 + 2 * blk)]
        cur = [b.fadd(b.shuffle_vector(cur[i], cur[i + m], ir.Constant(mask_t, lo_idx)),
                      b.shuffle_vector(cur[i], cur[i + m], ir.Constant(mask_t, hi_idx)))
               for i in range(m)]
        blk //= 2
    return cur[0]


__all__ = ["Fn", "emit"]
