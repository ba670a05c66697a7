"""Fused scoring + top-k: ``topk(x @ W.T, k)`` without materialising the score matrix.

Contract: for each of the ``m`` rows of x, the ``k`` best of the ``n`` scores ``x[i] . W[j]``,
values sorted best first and indices as ``torch.topk`` returns them on those scores (ATen's heap
path, ``k * 64 <= n``: the factory checks). W is pre-packed by the factory into ``nr``-wide
panels exactly as for ``linear``.

Schedule: the GEMM micro-kernel computes an ``mr x nr`` tile of scores in registers (K is not
blocked, so the tile is final) and screens it against each row's heap root as the row's last
filter left it (``roots``; NaN until the heap is full): only a tile with a lane that may enter
is stored to an L1 buffer, so most tiles cost no store and no filter. Each row of a stored tile
is compared 16 lanes at a time against the row's live root with ATen's NaN-aware strict test;
the few survivors (a bitmask walked with cttz, in index order) go through the exact heap step of
codegen/heap.py. The threshold only tightens, so a stale one filters nothing that matters (spec
§2.2).

Threads split the row tiles when there are enough, each thread owning whole rows and scanning
columns in order: its heaps are the exact ones. With fewer row tiles than threads (decode-sized
m), threads split the columns instead; each keeps its own heaps and logs every element that
entered them, and after the join the logs are replayed per row, in index order, through a fresh
heap. That is exact because an element its thread's heap rejected cannot enter the global heap
either (the global root is at least as strict), and the replay runs ATen's own step sequence on
the rest.

``m == 0`` is the generic kernel: the row count is an argument (see ``emit_main``), the row
tiles and the last tile's height are computed per call, and the row edge is served by variants
of every height up to ``mr`` (bf16 screening: the edge tile is packed at its own height; on
matrix tiles the edge block is read whole and its rows past the count are never screened).

bf16 (``dtype="bf16"``): x and W hold bf16 (K even, in k-pair words as in gemm.py), the tile is
computed by the bf16 GEMM micro-kernel (``vdpbf16ps`` or widened FMAs, float32 sums). The screen
and the row filter compare those float32 scores: a superset of the test on the rounded ones,
since rounding is monotone and leaves the (bf16) root as it is. Each candidate is rounded to
bf16 as the unfused linear rounds it before its heap step, which compares the rounded scores
widened to float32 (exact), as ATen's top-k compares bf16 values; so the indices are
``torch.topk``'s on the bf16 scores. Values are written as bf16.

Screening (float32 with AVX512_BF16): the tile is first computed approximately and only the
columns whose approximation plus a rigorous error bound could beat the heap root are rescored in
float32 (``emit_dot``). ``approx="bf16"``: bf16 weights and ``vdpbf16ps`` (on matrix tiles
``tdpbf16ps``). ``approx="int8"`` (where the screening is bound by the bytes it reads: one to
four rows on the vector path, any number on the tiles): int8 weights and ``vpdpbusd`` (on the
tiles ``tdpbsud``, the same s8 x and u8 weight operands), half the bytes; see topk_int8.py for
its bound. Survivors are rescored either way, so results are exact.

The generic kernel screens with int8 too, on the vector path for at most ``mr`` rows a call (its
caller sends it only those): one row tile, zero-padded past the rows.

Deferred rescoring (topk_int8.Deferred): with screening and one row tile on the vector path (the
generic kernel: at one row), the kernel first tries a path with no heap replay and no malloc:
threads screen their columns against the k-th best lower bound and keep candidates; after the join
only those that can still reach the top k are rescored. When their top k is unambiguous (k distinct
values, nothing tied with the k-th, no NaN) it is the answer; otherwise the exact schedule above
runs.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16 as bf
from . import simd
from .fused_topk_screen import PendingScreen, ScreenBounds, nonzero
from .gemm_bf16 import emit_dot, emit_micro_bf16, emit_pack_bf16
from .gemm_micro import FIRST, LAST, Micro, emit_micro
from .gemm_pack import emit_pack_rows
from .gemm_tile import block_product, block_registers, emit_pad_rows, padded_k
from .heap import Heap, lt
from .irutil import Fn, const, defined, f32, i1, i32, i64, intrinsic, new_module, ptr, void
from .tiles import Tiles
from .topk_int8 import MAX_INT8_K, Deferred, emit_micro_int8, emit_pack_int8

# rows x columns of a tile block of scores: 16-row blocks give 2 threads whole rows from 32
# rows on, where 32-row blocks left one row tile and the column split (its logs and merge):
# 32 x 20000 x 128, k = 10, 2 threads, Emerald Rapids: bf16 660 against 953 us, float32 801
# against 1216 us (one thread, and 64 rows: level)
TOPK_TILE = (16, 32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def emit(spec, target) -> ir.Module:
    return _Emitter(spec, target).module


class _Emitter(ScreenBounds):
    def __init__(self, spec, target):
        self.s = s = spec
        self.L = simd.float_lanes(target)
        if s.nr % self.L:
            raise ValueError(f"kwker topk: nr={s.nr} not a multiple of {self.L} lanes")
        self.module = new_module(s.symbol)
        self.np = _cdiv(s.n, s.nr)
        self.nr_edge = s.n - (self.np - 1) * s.nr
        self.bf16 = s.approx == "bf16"
        self.int8 = s.approx == "int8"
        self.screen = self.bf16 or self.int8
        self.half = s.dtype == "bf16"  # bf16 operands and scores (not the bf16 screening)
        if self.half and (self.bf16 or s.k_dim % 2):
            raise ValueError("kwker topk: bf16 scores need an even K and no screening")
        self.dot = "fma"
        if self.half:
            self.dot = "dpbf16" if bf.native(target) else "widen"
        self.kw = s.k_dim // 2 if self.half else s.k_dim  # k steps (words) of x and W
        if self.bf16 and not (bf.native(target) and s.nr % 16 == 0):
            raise ValueError("kwker topk: bf16 screening needs AVX512_BF16 and 16-lane panels")
        self.tiles = s.path == "tile"
        # int8 on the vector path: one row tile (the generic kernel's caller passes at most
        # ``mr`` rows)
        if self.int8 and not (self.L == 16 and s.nr % 16 == 0 and (s.mr >= s.m or self.tiles)
                              and s.k_dim <= MAX_INT8_K and not self.half):
            raise ValueError("kwker topk: int8 screening needs 16-lane panels, one row tile "
                             f"and K <= {MAX_INT8_K}")
        # k words of a packed A row: k pairs (bf16), k quads (int8), else k steps
        self.kwa = _cdiv(s.k_dim, 4) if self.int8 else (s.k_dim + 1) // 2 if self.bf16 else \
            self.kw
        # on matrix tiles: TOPK_TILE blocks, x packed in rows of pairs and W in panels, both
        # padded to whole tile steps (gemm_tile.py)
        if self.tiles:
            if not ((self.screen or self.half) and (s.mr, s.nr) == TOPK_TILE
                    and target.tiles in ("amx", "emulated")):
                raise ValueError("kwker topk: the tile path is for screening or bf16 scores, "
                                 f"in {TOPK_TILE} blocks, on a target with tiles")
            self.kwa = padded_k(self.kwa)
        self.tile_mode = target.tiles
        self.heap = Heap(self.module, s.largest)
        self.malloc = intrinsic(self.module, "malloc", ptr, [i64])
        self.free = intrinsic(self.module, "free", void, [ptr])
        self.filter_row = self.emit_filter_row()
        if self.tiles:
            # no calls in the loop over blocks: after each one LLVM loads the tile
            # configuration again (ldtilecfg), which cost more than the heap steps themselves
            # (16 x 20000 x 128 k=10, 1 thread: 583 -> 358 us; 32 rows, 2 threads 534 -> 355)
            for fn in (self.heap.push, self.heap.sift,
                       defined(self.module, f"dot.{s.k_dim}.{self.L}")):
                if fn is not None:
                    fn.attributes.add("alwaysinline")
        # one row tile of screened scores on the vector path: screen all, rescore the few that
        # can make the top k (by row count; the generic kernel's at one row, and with int8 at
        # every count it takes: Intel Xeon with AMX, 20000 x 128, k = 10, 2 rows 46-48 -> 23-25
        # us, 4 rows 68-69 -> 36-38, as the specialised kernels)
        self.fast = {}
        if self.screen and 0 < s.m <= s.mr and not self.tiles:
            self.fast = {s.m: Deferred(self, s.m, s.mr)}
        elif self.screen and not s.m and not self.tiles:
            self.fast = {r: Deferred(self, r, r) for r in range(1, s.mr + 1 if self.int8 else 2)}
        body = self.emit_body()
        self.emit_main(body)

    def micro(self, rows, cols):
        s = self.s
        return emit_micro(self.module, Micro(rows, _cdiv(cols, self.L), self.L, cols, 1, s.mr,
                                             s.nr, False, s.nr, dot=self.dot,
                                             screen=1 if s.largest else -1))

    # -- parallel body: ctx = x, w, vals, idx, split_cols, hv, hi, cnt, logv, logi, logn --------
    def emit_body(self) -> ir.Function:
        s = self.s
        f = Fn(self.module, f"{s.symbol}.body", void, [ptr, i64, i64], ["ctx", "tid", "nt"])
        self.f = f
        if self.tiles:  # vdpbf16ps in the emulation only where the CPU has it (as the screen)
            self.tile_ops = Tiles(f, self.tile_mode, self.bf16 or self.dot == "dpbf16")
            self.tile_regs = block_registers(self.tile_ops)
        b = f.b
        ctx, tid, nt = f.args
        x, w, vals, idx = (f.arg_ptr(ctx, i) for i in range(4))
        split_cols = b.icmp_signed("!=", f.arg_i64(ctx, 4), const(i64, 0))
        hv_all, hi_all, cnt_all, logv, logi, logn = (f.arg_ptr(ctx, i) for i in range(5, 11))
        w_exact, evec = f.arg_ptr(ctx, 12), f.arg_ptr(ctx, 13)
        m = s.m or f.arg_i64(ctx, 14)
        mt, mr_edge = self.row_tiles(b, m)

        with f.if_(b.icmp_signed("==", tid, const(i64, 0))):
            simd.store_scalar(b, nt, ctx, const(i64, 11))  # the team size the merge must use
        t0, t1 = f.var(i64, const(i64, 0)), f.var(i64, _v(mt))
        q0, q1 = f.var(i64, const(i64, 0)), f.var(i64, const(i64, self.np))
        with f.if_else(split_cols) as (cols, rows):
            with cols:
                q0.set(b.sdiv(b.mul(const(i64, self.np), tid), nt))
                q1.set(b.sdiv(b.mul(const(i64, self.np), b.add(tid, const(i64, 1))), nt))
            with rows:
                t0.set(b.sdiv(b.mul(_v(mt), tid), nt))
                t1.set(b.sdiv(b.mul(_v(mt), b.add(tid, const(i64, 1))), nt))
        # heap state: per thread in column mode (all rows), shared by row in row mode
        state_off = b.select(split_cols, b.mul(tid, _v(m)), const(i64, 0))
        hv = simd.gep(b, hv_all, b.mul(state_off, const(i64, s.k)))
        hi = simd.gep(b, hi_all, b.mul(state_off, const(i64, s.k)), i32)
        cnt = simd.gep(b, cnt_all, state_off, i64)
        nlog = simd.gep(b, logn, state_off, i64)

        row0 = b.mul(t0.get(), const(i64, s.mr))
        row1 = b.mul(t1.get(), const(i64, s.mr))
        row1 = b.select(b.icmp_signed("<", row1, _v(m)), row1, _v(m))
        with f.for_range(row0, row1, name="init") as r:
            simd.store_scalar(b, const(i64, 0), cnt, r)
            simd.store_scalar(b, const(i64, 0), nlog, r)

        kp = self.kwa
        a_floats = _mul(b, _add(b, m, s.mr), kp)
        raw_a = b.call(self.malloc, [_v(_add(b, _mul(b, _add(b, a_floats, _mul(b, m, 4)), 4),
                                             128))])
        # the float32 tile, and the stale heap root of each row the micro-kernel screens with
        # (on tiles two: a block's scores are screened while the next block's are computed)
        tile_floats = s.mr * s.nr * (2 if self.tiles else 1)
        raw_t = b.call(self.malloc, [_v(_add(b, _mul(b, m, 4), tile_floats * 4 + 128))])
        ap, tile = _align64(b, raw_a), _align64(b, raw_t)
        roots = simd.gep(b, tile, const(i64, tile_floats))
        with f.for_range(row0, row1, name="nan") as r:
            simd.store_scalar(b, ir.Constant(f32, float("nan")), roots, r)
        # |x_row| (bf16 screening), or 4 words of quantisation data per row (int8)
        qnorm = simd.gep(b, ap, _v(_add(b, a_floats, 16)))
        x_rows = simd.gep(b, x, b.mul(row0, const(i64, self.kw)))
        if self.int8:  # on tiles: rows of k-quad words padded to whole tile steps
            b.call(emit_pack_int8(self.module, s.mr, s.k_dim, kp if self.tiles else 0),
                   [x_rows, b.sub(row1, row0), ap, qnorm])
        elif self.bf16 and (s.m or self.tiles):  # whole tiles, zero past the rows
            b.call(emit_pack_bf16(self.module, s.mr, s.k_dim, kp if self.tiles else 0),
                   [x_rows, b.sub(row1, row0), ap, qnorm])
        elif self.bf16:
            self.pack_bf16_edge(f, x_rows, b.sub(row1, row0), ap, qnorm)
        elif self.tiles:  # bf16 operands: rows of k-pair words padded to whole tile steps
            b.call(emit_pad_rows(self.module, self.kw, kp), [x_rows, b.sub(row1, row0), ap])
        else:  # bf16 operands: rows of k-pair words, packed as words
            b.call(emit_pack_rows(self.module, s.mr, self.kw, self.L),
                   [x_rows, b.sub(row1, row0), const(i64, self.kw), ap])
        nullp = ir.Constant(ptr, None)
        # the widest screening bound of any column, stored after the columns' bounds: e_j
        # (bf16), or E1_j and E2_j (int8)
        e_max = None
        if self.screen and self.tiles:
            e_max = [simd.load_scalar(b, evec, const(i64, s.n * (3 if self.int8 else 1) + j))
                     for j in range(2 if self.int8 else 1)]
        log_base = b.mul(q0.get(), const(i64, s.nr))
        state = (hv, hi, cnt, nlog, logv, logi, b.zext(split_cols, i64), log_base)
        a_tile_size = s.mr * kp

        def filter_block(block, q, row_t, rows, cols, which=None):
            """Filter the rows of a block of scores (those of the ``which`` bitmask, if given):
            ``block`` holds them, ``q`` is its panel, ``row_t`` its first row."""
            with f.for_range(0, rows, name="fr") as r, \
                    f.if_(b.trunc(b.lshr(which, r), i1) if which else const(i1, 1)):
                extra = []
                if self.screen:
                    i_rel = b.sub(b.add(row_t, r), row0)
                    qn = simd.gep(b, qnorm, b.mul(i_rel, const(i64, 4))) if self.int8 \
                        else simd.load_scalar(b, qnorm, i_rel)
                    extra = [simd.gep(b, x, b.mul(b.add(row_t, r), const(i64, s.k_dim))),
                             qn, w_exact, evec]
                i = b.add(row_t, r)
                b.call(self.filter_row, [
                    simd.gep(b, block, b.mul(r, const(i64, s.nr))), i,
                    b.mul(q, const(i64, s.nr)), cols, *state, *extra])
                if not self.screen:  # the root the next tiles screen with
                    self.update_root(b, i, hv, cnt, roots)
                elif self.tiles:  # that root less the row's widest bound
                    self.update_screen_root(b, i, hv, cnt, roots, qn, e_max)

        pending = PendingScreen(self, roots, filter_block,
                                (qnorm, row0, evec) if self.int8 else None) if self.tiles else None
        with f.for_range(q0.get(), q1.get(), name="q") as q:
            wq = simd.gep(b, w, b.mul(q, const(i64, kp * s.nr)))
            with f.for_range(t0.get(), t1.get(), name="t") as t:
                a_tile = simd.gep(b, ap, b.mul(b.sub(t, t0.get()), const(i64, a_tile_size)))
                row_t = b.mul(t, const(i64, s.mr))

                def filter_rows(rows, cols, which=None):
                    filter_block(tile, q, row_t, rows, cols, which)

                last_q = b.icmp_signed("==", q, const(i64, self.np - 1))
                cols = b.select(last_q, const(i64, self.nr_edge), const(i64, s.nr))
                last_t = b.icmp_signed("==", t, _v(_add(b, mt, -1)))
                rows_v = b.select(last_t, _v(mr_edge), const(i64, s.mr))
                if self.tiles:
                    block = pending.next_block(tile)
                    self.tile_block(a_tile, wq, block, pending)
                    pending.filter()
                    pending.set(block, q, row_t, rows_v, cols)
                elif self.int8:
                    b.call(emit_micro_int8(self.module, s.mr, s.nr // 16, s.nr, kp),
                           [a_tile, wq, tile])
                elif self.bf16 and s.m:  # zero-padded operands: one full-tile variant
                    b.call(emit_micro_bf16(self.module, s.mr, s.nr // 16, s.nr),
                           [a_tile, wq, tile, const(i64, kp)])
                elif self.bf16:  # the edge tile is packed at its height
                    for rows in _variants(f, rows_v, s.mr, mr_edge, last_t):
                        b.call(emit_micro_bf16(self.module, rows, s.nr // 16, s.nr),
                               [a_tile, wq, tile, const(i64, kp)])
                else:  # screened float32 tiles: variants specialised to the edges
                    hit = f.var(i64, const(i64, 0), "hit")
                    tile_roots = simd.gep(b, roots, row_t)
                    for rows in _variants(f, rows_v, s.mr, mr_edge, last_t):
                        for ncols in _variants(f, cols, s.nr, self.nr_edge, last_q):
                            hit.set(b.call(self.micro(rows, ncols),
                                           [a_tile, wq, tile, const(i64, self.kw),
                                            const(i64, FIRST | LAST), nullp, nullp]
                                           + ([tile] if self.half else []) + [tile_roots]))
                            if s.m:
                                with f.if_(nonzero(b, hit.get()), likely=False):
                                    filter_rows(const(i64, rows), const(i64, ncols), hit.get())
                    if not s.m:  # generic: one filter per column variant, not per tile variant
                        with f.if_(nonzero(b, hit.get()), likely=False):
                            for ncols in _variants(f, cols, s.nr, self.nr_edge, last_q):
                                filter_rows(rows_v, const(i64, ncols), hit.get())
                if self.screen and not self.tiles:
                    filter_rows(rows_v, cols)
        if self.tiles:  # the thread's last block
            pending.run(const(i64, 0), const(i64, s.mr))
            pending.filter()
        # row mode: this thread's rows are final
        with f.if_(b.not_(split_cols)), f.for_range(row0, row1, name="out") as r:
            self.emit_output(f, r, simd.gep(b, hv, b.mul(r, const(i64, s.k))),
                             simd.gep(b, hi, b.mul(r, const(i64, s.k)), i32), vals, idx)
        b.call(self.free, [raw_a])
        b.call(self.free, [raw_t])
        return f.finish()

    def tile_block(self, a_tile, wq, tile, pending) -> None:
        """The 16 x 32 scores of one row tile and panel, on matrix tiles: bf16 approximations,
        int8 ones (s8 x rows times the u8 weight panels, ``tdpbsud``: the vector path's
        operands), or bf16 products. Every row tile streams all the weight panels, prefetched
        ``STREAM_AHEAD`` bytes ahead as the GEMM's pre-packed ones (Intel Xeon with AMX, 2
        threads, 20000 x 128, k = 10, float32, alternating processes: 32 rows 279-304 ->
        251-281 us, 77 rows 627-650 -> 553-576)."""
        f, kp = self.f, self.kwa
        b = f.b
        block_product(
            f, self.tile_ops, self.tile_regs,   # A: rows of kp words
            lambda k, i: simd.gep(b, a_tile, b.add(k, const(i64, i * 16 * kp)), i32),
            const(i64, kp * 4),
            lambda k, j: simd.gep(b, wq, b.add(b.mul(k, const(i64, 32)), const(i64, j * 16)),
                                  i32),
            const(i64, 32 * 4), tile, 32, const(i64, kp), const(i1, 1),
            int8="s8u8" if self.int8 else False, row_tiles=1,
            side=pending.rows_at_step, side_rest=pending.rows_after,
            b_ahead=simd.STREAM_AHEAD)

    def update_root(self, b, i, hv, cnt, roots):
        """roots[i] = row i's heap root once its heap is full, else NaN (every lane passes)."""
        full = b.icmp_signed("==", simd.load_scalar(b, cnt, i, i64), const(i64, self.s.k))
        root = simd.load_scalar(b, hv, b.mul(i, const(i64, self.s.k)))
        simd.store_scalar(b, b.select(full, root, ir.Constant(f32, float("nan"))), roots, i)

    def row_tiles(self, b, m):
        """(row tiles, rows in the last one) of ``m`` rows: ints when specialised, else IR."""
        mr = self.s.mr
        if isinstance(m, int):
            mt = _cdiv(m, mr)
            return mt, m - (mt - 1) * mr
        mt = b.udiv(b.add(m, const(i64, mr - 1)), const(i64, mr))
        return mt, b.sub(m, b.mul(b.sub(mt, const(i64, 1)), const(i64, mr)))

    def pack_bf16_edge(self, f, x_rows, rows, ap, qnorm):
        """Pack whole ``mr``-row tiles, then the partial last one at its own height (the
        height its micro-kernel variant reads)."""
        s, b = self.s, f.b
        mr = const(i64, s.mr)
        full = b.mul(b.udiv(rows, mr), mr)
        b.call(emit_pack_bf16(self.module, s.mr, s.k_dim), [x_rows, full, ap, qnorm])
        kp = (s.k_dim + 1) // 2
        edge = b.sub(rows, full)
        for h in range(1, s.mr):
            with f.if_(b.icmp_signed("==", edge, const(i64, h))):
                b.call(emit_pack_bf16(self.module, h, s.k_dim),
                       [simd.gep(b, x_rows, b.mul(full, const(i64, s.k_dim))), const(i64, h),
                        simd.gep(b, ap, b.mul(full, const(i64, kp))), simd.gep(b, qnorm, full)])

    def emit_filter_row(self) -> ir.Function:
        """``filter_row(tile_row, i, col0, cols, hv, hi, cnt, nlog, logv, logi, logging,
        log_base[, x_row, qnorm, w_exact, evec])``: feed the row's scores that can beat its
        threshold to its heap, in order. With bf16 screening the tile holds approximations:
        a lane survives if approx +- e_j |q| can beat the root, and survivors are rescored in
        float32 before the exact heap step."""
        s, L = self.s, self.L
        extra_t = [ptr, ptr if self.int8 else f32, ptr, ptr] if self.screen else []
        f = Fn(self.module, f"{s.symbol}.filter_row", void,
               [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64] + extra_t,
               ["row", "i", "col0", "cols", "hv", "hi", "cnt", "nlog", "logv", "logi",
                "logging", "log_base"] + (["xrow", "qn", "wx", "ev"] if self.screen else []))
        f.fn.attributes.add("alwaysinline")  # once per tile row: a call of 12+ args per row
        b = f.b
        row, i, col0, cols, hv, hi, cnt, nlog, logv, logi, logging, log_base = f.args[:12]
        k = const(i64, s.k)
        rhv = simd.gep(b, hv, b.mul(i, k))
        rhi = simd.gep(b, hi, b.mul(i, k), i32)
        rcnt = simd.gep(b, cnt, i, i64)
        log = (nlog, logv, logi, b.icmp_signed("!=", logging, const(i64, 0)), log_base)
        if self.screen:
            xrow, qn, wx, ev = f.args[12:]
            dot = emit_dot(self.module, s.k_dim, L)
        if self.screen:
            setup = self.screen_setup(b, qn)

        def push(c):
            j = b.add(col0, c)
            if self.screen:
                v = b.call(dot, [xrow, simd.gep(b, wx, b.mul(j, const(i64, s.k_dim)))])
            elif self.half:  # the bf16 score, as the unfused linear rounds it
                v = bf.widen_scalar(b, bf.narrow_scalar(b, simd.load_scalar(b, row, c),
                                                        self.dot == "dpbf16"))
            else:
                v = simd.load_scalar(b, row, c)
            self.push(f, i, rhv, rhi, rcnt, v, j, log)

        # until the heap is full every element enters it (no screening); from the column where
        # it fills, the rest of the tile is screened: a first tile is not rescored whole
        start = f.var(i64, const(i64, 0), "start")
        with f.if_(b.icmp_signed("<", b.load(rcnt, typ=i64), k), likely=False):
            with f.while_(lambda: b.and_(b.icmp_signed("<", start.get(), cols),
                                         b.icmp_signed("<", b.load(rcnt, typ=i64), k))):
                push(start.get())
                start.set(b.add(start.get(), const(i64, 1)))
        first = start.get()
        for v in range(s.nr // L):
            live = simd.lane_mask(b, L, b.sub(cols, const(i64, v * L)))
            xv = simd.load_vec(b, row, const(i64, v * L), L)
            thr = simd.broadcast(b, simd.load_scalar(b, rhv, const(i64, 0)), L)
            if self.screen:
                xv, e = self.screen_lanes(b, setup, row, ev, col0, v, live)
                hit = b.fcmp_unordered(">", b.fadd(xv, e), thr) if s.largest else \
                    b.fcmp_unordered("<", b.fsub(xv, e), thr)
            else:
                hit = lt(b, xv, thr, s.largest)
            hit = b.and_(hit, live)
            bits = b.zext(b.bitcast(hit, ir.IntType(L)), i64)
            # lanes before the first screened column were pushed above
            skip = b.sub(first, const(i64, v * L))
            skip = b.select(b.icmp_signed("<", skip, const(i64, 0)), const(i64, 0),
                            b.select(b.icmp_signed(">", skip, const(i64, L)), const(i64, L),
                                     skip))
            bits = b.and_(bits, b.shl(const(i64, -1), skip))
            word = f.var(i64, bits, "bits")
            with f.while_(lambda: b.icmp_unsigned("!=", word.get(), const(i64, 0))):
                wv = word.get()
                lane = f.call_intrinsic("llvm.cttz.i64", i64, [wv, const(i1, 0)])
                word.set(b.and_(wv, b.sub(wv, const(i64, 1))))
                push(b.add(const(i64, v * L), lane))
        return f.finish()

    def push(self, f, i, rhv, rhi, rcnt, v, col, log):
        """One exact heap step; in column mode, log the element if it entered the heap."""
        s, b = self.s, f.b
        nlog, logv, logi, logging, log_base = log
        entered = b.call(self.heap.push, [rhv, rhi, rcnt, const(i64, s.k), v,
                                          b.trunc(col, i32)])
        with f.if_(b.and_(entered, logging)):
            slot = simd.gep(b, nlog, i, i64)
            n = b.load(slot, typ=i64)
            b.store(b.add(n, const(i64, 1)), slot)
            # the thread's columns [c0, c1) own the stretch [c0, c1) of row i's log
            pos = b.add(b.mul(i, const(i64, s.n)), b.add(log_base, n))
            simd.store_scalar(b, v, logv, pos)
            simd.store_scalar(b, b.trunc(col, i32), logi, pos)

    def emit_output(self, f, r, rhv, rhi, vals, idx):
        s, b = self.s, f.b
        b.call(self.heap.sort, [rhv, rhi, const(i64, s.k)])
        with f.for_range(0, s.k, name="o") as j:
            pos = b.add(b.mul(r, const(i64, s.k)), j)
            v = simd.load_scalar(b, rhv, j)
            if self.half:
                v = bf.narrow_scalar(b, v, self.dot == "dpbf16")
            simd.store_scalar(b, v, vals, pos)
            simd.store_scalar(b, b.sext(simd.load_scalar(b, rhi, j, i32), i64), idx, pos)

    def emit_main(self, body):
        """Export ``sym(x, w, vals, idx, wexact, evec[, m], nthreads)`` (``m`` in the generic
        kernel only): split, fork, merge, free."""
        s, mod = self.s, self.module
        gomp = intrinsic(mod, "GOMP_parallel", void, [ptr, ptr, i32, i32])
        tnum = intrinsic(mod, "omp_get_thread_num", i32, [])
        tcount = intrinsic(mod, "omp_get_num_threads", i32, [])
        outlined = Fn(mod, f"{s.symbol}.omp", void, [ptr], ["ctx"])
        ob = outlined.b
        ob.call(body, [outlined.args[0], ob.sext(ob.call(tnum, []), i64),
                       ob.sext(ob.call(tcount, []), i64)])
        outlined.finish()

        rows = [] if s.m else [i64]
        f = Fn(mod, s.symbol, void, [ptr] * 6 + rows + [i64],
               ["x", "w", "vals", "idx", "wexact", "evec"] + ["m"] * len(rows) + ["nthreads"],
               internal=False)
        self.f = f
        b = f.b
        x, w, vals, idx, w_exact, evec = f.args[:6]
        nreq = f.args[-1]
        m = s.m or f.args[6]
        for count, fast in self.fast.items():  # usually decides alone; ties, NaN or overflow
            # take the exact path
            these = const(i1, 1) if s.m else b.icmp_signed("==", m, const(i64, count))
            with f.if_(these), f.if_(b.call(fast.fn, [x, w, vals, idx, w_exact, evec, nreq])):
                f.ret()
        mt, _ = self.row_tiles(b, m)
        if s.m:
            cap = const(i64, max(1, min(max(mt, self.np), 2 * s.m * s.n * s.k_dim >> 18)))
        else:  # the same cap from m: enough tiles to share, ~256 kflop per thread
            cap = b.select(b.icmp_signed(">", mt, const(i64, self.np)), mt,
                           const(i64, self.np))
            work = b.lshr(b.mul(m, const(i64, 2 * s.n * s.k_dim)), const(i64, 18))
            cap = b.select(b.icmp_signed("<", work, cap), work, cap)
            cap = b.select(b.icmp_signed("<", cap, const(i64, 1)), const(i64, 1), cap)
        nt = b.select(b.icmp_signed("<", nreq, cap), nreq, cap)
        nt = b.select(b.icmp_signed("<", nt, const(i64, 1)), const(i64, 1), nt)
        split_cols = b.and_(b.icmp_signed(">", nt, const(i64, 1)),
                            b.icmp_signed("<", _v(mt), nt))
        nt = b.select(b.and_(split_cols, b.icmp_signed(">", nt, const(i64, self.np))),
                      const(i64, self.np), nt)
        copies = b.select(split_cols, nt, const(i64, 1))
        per = b.mul(copies, _v(m))
        bufs = [b.mul(per, const(i64, s.k * 4)), b.mul(per, const(i64, s.k * 4)),
                b.mul(per, const(i64, 8)), b.mul(per, const(i64, 8))]
        logsz = b.select(split_cols, _v(_mul(b, m, s.n * 4)), const(i64, 0))
        bufs[3:3] = [logsz, logsz]
        raws = [b.call(self.malloc, [b.add(n, const(i64, 64))]) for n in bufs]
        hv, hi, cnt, logv, logi, logn = (_align64(b, r) for r in raws)
        with b.goto_block(f.entry):
            block = b.alloca(i64, size=14 + len(rows), name="ctx")
        for slot, v in enumerate([x, w, vals, idx, b.zext(split_cols, i64), hv, hi, cnt, logv,
                                  logi, logn, const(i64, 1), w_exact, evec] + [m] * len(rows)):
            if isinstance(v.type, ir.PointerType):
                v = b.ptrtoint(v, i64)
            f.store(v, block, const(i64, slot))
        with f.if_else(b.icmp_signed("<=", nt, const(i64, 1))) as (serial, par):
            with serial:
                b.call(body, [block, const(i64, 0), const(i64, 1)])
            with par:
                b.call(gomp, [outlined.fn, block, b.trunc(nt, i32), const(i32, 0)])
        with f.if_(split_cols):
            self.emit_merge(f, m, f.arg_i64(block, 11), hv, hi, cnt, logv, logi, logn, vals,
                            idx)
        for r in raws:
            b.call(self.free, [r])
        f.finish()

    def emit_merge(self, f, m, team, hv, hi, cnt, logv, logi, logn, vals, idx):
        """Replay every thread's log of row i, in column order, through a fresh heap."""
        s, b = self.s, f.b
        k = const(i64, s.k)
        with f.for_range(0, m, name="row") as i:
            rhv = simd.gep(b, hv, b.mul(i, k))  # thread 0's heap of this row is free now
            rhi = simd.gep(b, hi, b.mul(i, k), i32)
            rcnt = simd.gep(b, cnt, i, i64)
            simd.store_scalar(b, const(i64, 0), rcnt, const(i64, 0))
            with f.for_range(0, team, name="t") as t:
                c0 = b.mul(b.sdiv(b.mul(const(i64, self.np), t), team), const(i64, s.nr))
                n = simd.load_scalar(b, logn, b.add(b.mul(t, _v(m)), i), i64)
                base = b.add(b.mul(i, const(i64, s.n)), c0)
                with f.for_range(0, n, name="e") as e:
                    pos = b.add(base, e)
                    b.call(self.heap.push, [rhv, rhi, rcnt, k, simd.load_scalar(b, logv, pos),
                                            simd.load_scalar(b, logi, pos, i32)])
            self.emit_output(f, i, rhv, rhi, vals, idx)


def _v(x) -> ir.Value:
    return x if isinstance(x, ir.Value) else const(i64, x)


def _add(b: ir.IRBuilder, x, y):
    """x + y folded when both are ints (a specialised size), else an i64 instruction."""
    return x + y if isinstance(x, int) and isinstance(y, int) else b.add(_v(x), _v(y))


def _mul(b: ir.IRBuilder, x, y):
    return x * y if isinstance(x, int) and isinstance(y, int) else b.mul(_v(x), _v(y))


def _variants(f: Fn, value, full: int, edge, last):
    """Enter the branch of each size variant of a tile dimension, yielding its size. A
    compile-time ``edge`` has the full and the edge variant, told apart by ``last``; a runtime
    one (generic m) has every size 1..full, picked by ``value``."""
    b = f.b
    if not isinstance(edge, int):
        for size in range(1, full + 1):
            with f.if_(b.icmp_signed("==", value, const(i64, size))):
                yield size
        return
    for size in sorted({full, edge}):
        cond = last
        if size == full and edge != full:
            cond = b.not_(cond)
        elif edge == full:
            cond = const(i1, 1)
        with f.if_(cond):
            yield size


def _align64(b: ir.IRBuilder, raw: ir.Value) -> ir.Value:
    addr = b.ptrtoint(raw, i64)
    pad = b.and_(b.sub(const(i64, 64), b.and_(addr, const(i64, 63))), const(i64, 63))
    return b.gep(raw, [pad], inbounds=True, source_etype=ir.IntType(8))


__all__ = ["emit", "f32"]
