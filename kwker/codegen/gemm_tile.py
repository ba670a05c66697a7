"""The tile form of the GEMM micro-kernel contract: 32 x 32 blocks of C on matrix tiles (AMX).

Same loop nest, threads, K blocks, partial sums and epilogues as the vector path (gemm.py), with
the register tile replaced by 2 x 2 float32 accumulator tiles (``tiles.py``): per step of 16 k
pairs, two A tiles (16 rows of 32 bf16 each) and two B tiles (16 k-pair rows of 16 columns) feed
four ``tdpbf16ps``. Eight tile registers in all, every one of the single full shape.

Operands in tile layout:
- B: the pair-interleaved panels of the vector path (``nr`` = 32 columns, one word per k pair
  and column) are AMX's B layout already: a B tile is 16 panel rows, 128 bytes apart. Each
  pre-packed panel's K is zero-padded to whole steps (``padded_k``), so the last step of K reads
  zeros, not the next panel; a runtime B is packed per K block the same way (a low-bit B
  dequantised on the way, gemm.py's ``b_bits``). B tiles are loaded around L1
  (``tileloaddt1``): each is read once per pass of a row tile, and A's sub-block is what L1
  must keep (``SUB_PAIRS``). Pre-packed panels are prefetched ``simd.STREAM_AHEAD`` bytes
  ahead into L2 in the pass of a chunk's first row tile, which brings the B block from memory
  (Emerald Rapids, 2 threads, bf16, weights evicted between calls, in one process, against
  prefetching into L1 in every pass: 8 x 4096 x 1024 186-202 -> 193-215 GFLOP/s, 32 x 4096 x
  1024 745-820 -> 793-841, 128 x 4096 x 1024 1445-1583 -> 1525-1715; no prefetch at all:
  166-182 / 667-736 / 1421-1606). The later passes read the block from L2 without prefetches,
  which in the caches cost 1024 x 3072 x 768 7-9%.
- A: packed per chunk of row tiles and K block into tile-contiguous blocks (``pack_a_tiles``:
  for each step, 32 rows x 16 words, the 16-row halves 1 KB apart). Reading A in place would
  put the rows of a tile a power of two apart for the usual K (768 -> 1.5 KB, 1024 -> 2 KB,
  2048 -> 4 KB): one L1 set per tile, measured 382 against 2326 GFLOP/s at K = 2048 on Emerald
  Rapids. Packing also zero-fills the edge: rows past M and k pairs past K.
- C: the accumulators are stored whole (1 KB a tile) into a float32 scratch, per block of 32 x
  32 (4 KB, row stride 128 bytes, no set conflicts), between the sub-blocks of K
  (``SUB_PAIRS``: a row tile's A slice in L1 across the panels of a B block) and across K
  blocks: one block per panel of the B block where K is one block, else one per (row tile,
  panel) of a thread's chunk. The last product of a block runs the vector epilogue (bias,
  activation, residual, one rounding to bf16) over the valid rows and columns, so edge tiles
  need no other shape.

int8 (``dtype="u8s8"``, the groundwork of low-bit weights): the same nest on ``tdpbusd``, u8
activations times s8 weights, a 32-bit word holding 4 k each (A rows of k quads, weight panels
of one quad word per column, zero-padded as above), int32 sums. The epilogue converts each sum
to float32, multiplies it by its column's scale and adds the bias: the ``bias`` operand holds
the scales, zero-padded to whole panels (``np * nr`` floats), then the bias padded alike. The
output is float32. With ``planes`` (the low-bit prefill's byte planes of x, rows of 2 or 3 per x
row) a row tile takes 30 rows of A (10 x rows' three planes; 32 of two), the last two zero, and
its epilogue combines each x row's planes from the block's int32 sums, as the vector
micro-kernel's does (gemm_lowbit_vnni.combine_planes), before the bias, activation and residual
of the x rows (row stride ``ldo``). Against int4's grouped panels (``b_group``: a scale per 32 k)
the sums restart every group, one tile step each, and are combined per group
(gemm_tile_grouped.py).
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .gemm_lowbit_vnni import HEAD, combine_planes, load_factor
from .gemm_micro import epilogue_rows
from .gemm_pack import emit_pack_cols, emit_pack_rows
from .gemm_tile_grouped import a_spread, group_words, grouped_product
from .irutil import (
    Fn,
    aligned_malloc,
    const,
    defined,
    i1,
    i8,
    i16,
    i32,
    i64,
    intrinsic,
    ptr,
    smin,
    void,
)
from .tiles import Tiles, tile_step

TILE_BLOCK = (32, 32)   # rows x columns of C per block: 2 x 2 accumulator tiles
B_ROW_BYTES = TILE_BLOCK[1] * 4   # a k-pair row of a B panel (the two B tiles side by side)
STEP = 16               # k pairs per tile product (64 bytes of a tile row)
BLOCK_WORDS = 32 * 32   # float32 words of one C block in the scratch
# rows up to which the vector path beats the tiles (Emerald Rapids, bf16, 2 threads, N x K of
# 4096 x 1024, 1024 x 4096, 768 x 768: at 4 rows vector 332/285/32 us against tiles 387/387/27,
# at 8 rows 437/444/61 against 223/255/30): factories pick the vector path up to here, and a
# generic tile kernel serves that many rows with the vector small-M schedule
VECTOR_ROWS = 4
I32x16 = ir.VectorType(i32, 16)


def padded_k(kw: int) -> int:
    """k pairs of a panel on the tile path: whole steps, the tail zero-filled."""
    return -(-kw // STEP) * STEP


def allocate(f: Fn, p) -> tuple[list, tuple]:
    """Per-thread buffers: (raw pointers to free, (packed A chunk, packed B block, scratch))."""
    s = p.s
    kcp = padded_k(p.kc)
    raws = []
    spread = a_spread(s.plane_bits) if p.grouped else 1   # packed A's words a word of A
    raw, ap = aligned_malloc(f, p.tiles_per_chunk * 32 * kcp * 4 * spread)
    raws.append(raw)
    bp = None
    if p.pack_b:
        raw, bp = aligned_malloc(f, s.nb * s.nr * kcp * 4)
        raws.append(raw)
    blocks = s.nb if p.one_block else p.tiles_per_chunk * p.np
    raw, acc = aligned_malloc(f, blocks * BLOCK_WORDS * 4)
    raws.append(raw)
    if p.grouped:   # a group's int32 tiles, combined from there
        raw, gbuf = aligned_malloc(f, BLOCK_WORDS * 4)
        raws.append(raw)
        return raws, (ap, bp, acc, gbuf)
    return raws, (ap, bp, acc)


def emit_nest(f: Fn, p, ptrs, m_rows, n_batch, mt, split, bufs, quant=None,
              pack_lowbit=None) -> None:
    """The tile loop nest of one thread (module doc); ``split`` and ``bufs`` as gemm.py's,
    ``quant``: with byte planes, the x rows' heads, the columns' scales and sums of q; with a
    low-bit B, its scales, zero points and row buffer, which ``pack_lowbit`` (gemm.py) packs
    its panels through."""
    s, b, module = p.s, f.b, f.module
    a_all, b_all, bias, res_all, c_all = ptrs
    bt0, bt1, t0, t1, q0, q1, u0, u1 = split
    ap, bp, acc = bufs[:3]
    kw, nr = p.kw, s.nr
    tiles = Tiles(f, p.tile_mode, native_bf16=p.dot == "dpbf16")
    regs = block_registers(tiles)
    spread = a_spread(s.plane_bits) if p.grouped else 1   # packed A's words a word of A
    # 12-bit planes: a tile of 16 x rows' low digits (u8), one of their high digits (s8)
    pack_a = emit_pack_a_tiles(module, kw, p.a_rows, STEP // spread,
                               planes_apart=p.grouped and s.plane_bits == 12)
    a_rows = const(i64, p.a_rows)
    pack_b = None  # a runtime B's packer (a low-bit B has its own)
    if pack_lowbit is None and s.b_layout == "nk":
        pack_b = emit_pack_rows(module, nr, kw, p.lanes)
    elif pack_lowbit is None and p.pack_b:
        pack_b = emit_pack_cols(module, nr, s.n, p.lanes, pairs=True)

    out_t = p.out_t   # bf16, or float32 (u8s8, or a bf16 product with a float32 residual)
    pending = _PendingEpilogue(f, p, bias, out_t, quant)
    sub = sub_pairs(p)

    def at(base, index, ty=out_t):
        return simd.gep(b, base, index, ty)

    with f.for_range(bt0.get(), bt1.get(), name="batch") as bi:
        a_mat = simd.gep(b, a_all, b.mul(b.mul(bi, m_rows), const(i64, kw)), i32)
        mn = b.mul(b.mul(bi, m_rows), const(i64, s.n))
        c_mat = at(c_all, mn)
        r_mat = at(res_all, mn) if s.residual else None
        b_mat = b_all if s.b_layout == "packed" else \
            at(b_all, b.mul(bi, const(i64, s.k * s.n)), i16)
        with f.for_range(t0.get(), t1.get(), step=p.tiles_per_chunk, name="jc") as tc0:
            tc1 = smin(b, b.add(tc0, const(i64, p.tiles_per_chunk)), t1.get())
            row0 = b.mul(tc0, a_rows)
            rows = b.sub(smin(b, b.mul(tc1, a_rows), m_rows), row0)
            with f.for_range(0, kw, step=p.kc, name="pc") as k0:
                kcl = smin(b, b.sub(const(i64, kw), k0), const(i64, p.kc))
                kcp = b.and_(b.add(kcl, const(i64, STEP - 1)), const(i64, -STEP))
                first = b.icmp_signed("==", k0, const(i64, 0))
                last = b.icmp_signed("==", b.add(k0, kcl), const(i64, kw))
                b.call(pack_a, [simd.gep(b, a_mat, b.add(b.mul(row0, const(i64, kw)), k0), i32),
                                rows, kcl, ap])
                with f.for_range(q0.get(), q1.get(), step=s.nb, name="ic") as qb0:
                    qb1 = smin(b, b.add(qb0, const(i64, s.nb)), q1.get())
                    if pack_lowbit is not None:
                        pack_lowbit(f, b_all, quant, qb0, qb1, k0, kcl, bp, kcp)
                        _zero_pad(f, p, qb0, qb1, kcl, kcp, bp)
                    elif p.pack_b:
                        _pack_b_block(f, p, pack_b, b_mat, qb0, qb1, k0, kcl, kcp, bp)
                    with f.for_range(tc0, tc1, name="jr") as t:
                        a_tile = simd.gep(b, ap, b.mul(b.sub(t, tc0),
                                                       b.mul(kcp, const(i64, 32 * spread))), i32)
                        with f.for_range(0, kcp, step=sub, name="kk") as kk:
                            steps = smin(b, b.sub(kcp, kk), const(i64, sub))
                            ends = b.and_(last, b.icmp_signed(">=", b.add(kk, steps), kcp))
                            from_zero = b.and_(first, b.icmp_signed("==", kk, const(i64, 0)))
                            a_sub = simd.gep(b, a_tile, b.mul(kk, const(i64, 32)), i32)
                            with f.for_range(qb0, qb1, name="ir") as q:
                                unit = b.add(b.mul(q, mt), t)
                                with f.if_(b.and_(b.icmp_signed(">=", unit, u0.get()),
                                                  b.icmp_signed("<", unit, u1.get()))):
                                    index = b.sub(q, qb0) if p.one_block else \
                                        b.add(b.mul(b.sub(t, tc0), const(i64, p.np)), q)
                                    block = simd.gep(b, acc, b.mul(index, const(i64,
                                                                                BLOCK_WORDS)))
                                    out_row = b.mul(t, const(i64, p.out_rows))
                                    off = b.add(b.mul(out_row, const(i64, p.ldo)),
                                                b.mul(q, const(i64, nr)))
                                    out, res = at(c_mat, off), \
                                        at(r_mat, off) if s.residual else None
                                    rows_left = b.sub(m_rows, b.mul(t, a_rows))
                                    if p.grouped:
                                        _grouped(f, p, tiles, regs, a_tile, b_mat, q,
                                                 b.add(k0, kk), kk, steps, from_zero, ends,
                                                 block, bufs[3], quant, out_row, rows_left,
                                                 bias, out, res)
                                    else:
                                        b_panel = _b_panel(f, p, bp, b_mat, q, qb0, kcp,
                                                           b.add(k0, kk), kk)
                                        _product(f, p, tiles, regs, a_sub, b_panel, block,
                                                 steps, from_zero, pending,
                                                 b.icmp_signed("==", t, tc0))
                                        pending.set(ends, block, q, rows_left, out, res,
                                                    out_row)
    if not p.grouped:   # (grouped blocks run their epilogues themselves)
        pending.finish()


# k pairs (int8: quads) of one block product at most: the 32-row A slice of a sub-block (up to
# 32 KB) stays in L1 while the products of every panel of the B block read it, where a whole K
# block of A (48 KB at K = 768) streamed from L2 beside each B panel. This holds with B kept out
# of L1 (``block_product``'s ``b_once``); B read through L1 and prefetched into it allowed no
# more than 16 KB (128 pairs), and the same 16 KB sub-blocks measured no faster with B around
# L1: the larger A slice is what gains, by fewer float32 round trips of C (Emerald Rapids,
# 2 threads, bf16 + bias, in one process, 128 pairs through L1 -> 192-256 pairs around it:
# 1024 x 3072 x 768 2050-2147 -> 2325-2693 GFLOP/s, 1024^3 2093-2347 -> 2476-2843,
# 128 x 768 x 768 2085-2267 -> 2431-2906, 256 x 4096 x 1024 2038-2152 -> 2222-2562)
SUB_PAIRS = 256
GROUPED_SUB = 64


def sub_pairs(p) -> int:
    """k pairs per block product: a K block in equal sub-blocks of at most ``SUB_PAIRS``. With
    several K blocks the sums of every (row tile, panel) block of a chunk pass through the
    scratch (1 MB at 256 x 4096 x 4096); whole K blocks there measured 5-10% faster while B went
    through L1, and 1-4% slower since (1024 x 1024 x 4096, 64 / 256 x 1024 x 4096, 512 x 768 x
    3072, 1024 x 4096 x 4096, two runs in one process, Emerald Rapids)."""
    if p.grouped:   # 8 groups (16 KB of A with its zero words)
        return GROUPED_SUB
    kcp = padded_k(p.kc)
    return padded_k(-(-kcp // -(-kcp // SUB_PAIRS)))


def _grouped(f: Fn, p, tiles, regs, a_tile, b_mat, q, k, kk, words, first, last, block, gbuf,
             quant, out_row, rows_left, bias, out, res) -> None:
    """Block (row tile, panel ``q``) of the grouped int4 product (gemm_tile_grouped.py) over
    ``words`` words of A from word ``k`` (``kk`` into the packed row tile ``a_tile``), B from the
    pre-packed grouped panels; after the last, the epilogue of its valid x rows."""
    b, nr = f.b, p.s.nr
    b_panel = simd.gep(b, b_mat, b.add(b.mul(q, const(i64, p.panel_rows(p.kw_panel) * nr)),
                                       b.mul(p.panel_rows(k, b), const(i64, nr))), i32)
    group = group_words(p.s.plane_bits)
    a_sub = simd.gep(b, a_tile, b.mul(kk, const(i64, 32 * a_spread(p.s.plane_bits))), i32)
    x_rows = b.udiv(smin(b, rows_left, const(i64, p.a_rows)), const(i64, p.planes))
    groups = b.udiv(words, const(i64, group))
    grouped_product(f, p, tiles, regs, a_sub, b_panel, groups, first, last, block, gbuf,
                    quant, out_row, x_rows)
    with f.if_(last):
        _epilogue(f, p, block, q, x_rows, bias, out, res)


def _b_panel(f: Fn, p, bp, b_mat, q, qb0, kcp, k, kk) -> ir.Value:
    """Where panel ``q``'s B tiles start at pair ``k`` of K (``kk`` into the K block): in the
    block packed per call (``kcp`` pairs a panel), or in the pre-packed panels."""
    b, nr = f.b, p.s.nr
    if p.pack_b:
        return simd.gep(b, bp, b.add(b.mul(b.sub(q, qb0), b.mul(kcp, const(i64, nr))),
                                     b.mul(kk, const(i64, nr))), i32)
    return simd.gep(b, b_mat, b.add(b.mul(q, const(i64, p.kw_panel * nr)),
                                    b.mul(k, const(i64, nr))), i32)


def _product(f: Fn, p, tiles, regs, a_sub, b_panel, block, steps, from_zero, pending,
             first_tile) -> None:
    """One block product over ``steps`` pairs: A from its packed row tile, B from its panel
    (rows ``nr`` words apart), the sums through ``block``; the pending epilogue between.
    Pre-packed B is prefetched (into L2) in the pass of a chunk's first row tile
    (``first_tile``, an i1), which brings the B block from memory; the others find it in L2."""
    b, nr = f.b, p.s.nr

    def product(b_ahead: int) -> None:
        block_product(
            f, tiles, regs,
            lambda k, i: simd.gep(b, a_sub, b.add(b.mul(k, const(i64, 32)),
                                                  const(i64, i * 256)), i32),
            const(i64, 64),
            lambda k, j: simd.gep(b, b_panel, b.add(b.mul(k, const(i64, nr)),
                                                    const(i64, j * 16)), i32),
            const(i64, nr * 4), block, 32, steps, from_zero, p.int8,
            side=pending.side, side_rest=pending.side_rest, b_ahead=b_ahead, b_once=True)

    if p.pack_b or not p.prefetch:
        product(0)
        return
    with f.if_else(first_tile) as (streamed, cached):
        with streamed:
            product(p.prefetch)
        with cached:
            product(0)


class StepSlices:
    """Vector work over a block's rows spread across the tile steps of a block product
    (``block_product``'s ``side`` and ``side_rest``): ``per_step`` rows in each step, then the
    rows no step took. A subclass sets ``f``, ``per_step`` and ``block_rows`` and defines
    ``run(r0, r1)`` for rows [r0, r1) (i64 values)."""

    def rows_at_step(self, step) -> None:
        """The slice of tile step ``step`` (i64): ``per_step`` rows from ``per_step * step``."""
        b = self.f.b
        r0 = b.mul(step, const(i64, self.per_step))
        self.run(r0, b.add(r0, const(i64, self.per_step)))

    def rows_after(self, steps) -> None:
        """After a product of ``steps`` tile steps: the rows no step took."""
        b = self.f.b
        self.run(smin(b, b.mul(steps, const(i64, self.per_step)),
                      const(i64, self.block_rows)), const(i64, self.block_rows))


class _PendingEpilogue(StepSlices):
    """The epilogue of the last finished block, deferred: run in slices of a few rows between
    the tile products of the next block, its vector math then overlaps the tile unit's work
    instead of stalling it between blocks (Emerald Rapids, 2 threads, linear + GELU-tanh in
    bf16: 128 x 1536 x 384 1068 -> 1350 GFLOP/s, 1024^3 1380 -> 1581; + SiLU, in one process:
    1024 x 3072 x 768 1200-1227 -> 1571-1601, 256 x 768 x 768 999-1036 -> 1261-1288). A plain
    epilogue (bias, the rounding) gains too since A's sub-blocks stay in L1 (``SUB_PAIRS``):
    1024 x 3072 x 768 2235-2274 -> 2325-2396, 1024^3 2332-2432 -> 2476-2528, 128 x 768 x 768
    2242-2333 -> 2431-2535 (in one process); with B through L1 it measured no faster, at 128
    rows up to 12% slower. Byte planes are combined first, all rows at once: not deferred."""

    def __init__(self, f: Fn, p, bias, out_t, quant=None):
        self.f, self.p, self.bias, self.out_t, self.quant = f, p, bias, out_t, quant
        self.deferred = not p.planes
        # rows per tile step: the 32 rows spread over a (full) product's steps
        self.per_step = -(-32 // (sub_pairs(p) // STEP))
        self.block_rows = 32
        self.side = self.rows_at_step if self.deferred else None
        self.side_rest = self.rows_after if self.deferred else None
        self.on = f.var(i1, const(i1, 0), "pend")
        self.block = f.var(ptr, ir.Constant(ptr, None), "pend.block")
        self.q = f.var(i64, const(i64, 0), "pend.q")
        self.rows = f.var(i64, const(i64, 0), "pend.rows")
        self.out = f.var(ptr, ir.Constant(ptr, None), "pend.out")
        self.res = f.var(ptr, ir.Constant(ptr, None), "pend.res")
        self.out_row = f.var(i64, const(i64, 0), "pend.row")

    def set(self, last, block, q, rows_left, out, res, out_row) -> None:
        """After a block product: its epilogue is pending if it finished the block's K;
        ``out_row``: the block's first output row (with byte planes, its first x row)."""
        b = self.f.b
        self.on.set(last)
        self.block.set(block)
        self.q.set(q)
        self.rows.set(smin(b, rows_left, const(i64, self.p.a_rows)))
        self.out.set(out)
        self.out_row.set(out_row)
        if res is not None:
            self.res.set(res)
        if not self.deferred:
            self.finish()

    def run(self, r0, r1) -> None:
        """Rows [r0, r1) of the pending epilogue (i64 values), clipped to its valid rows."""
        f, b, p = self.f, self.f.b, self.p
        count = b.sub(smin(b, self.rows.get(), r1), r0)
        with f.if_(b.and_(self.on.get(), b.icmp_signed(">", count, const(i64, 0)))):
            n = p.ldo   # the output's (and residual's) row stride
            res = simd.gep(b, self.res.get(), b.mul(r0, const(i64, n)), self.out_t) \
                if p.s.residual else None
            block = simd.gep(b, self.block.get(), b.mul(r0, const(i64, 32)))
            if p.planes:
                count = _combine_planes(f, p, block, self.q.get(), count, self.quant,
                                        self.out_row.get())
            _epilogue(f, p, block, self.q.get(), count, self.bias,
                      simd.gep(b, self.out.get(), b.mul(r0, const(i64, n)), self.out_t), res)

    def finish(self) -> None:
        """The pending epilogue, whole: at once when it is not deferred, else the thread's
        last one at its end."""
        self.run(const(i64, 0), const(i64, 32))
        self.on.set(const(i1, 0))


def block_registers(tiles: Tiles) -> dict:
    """The eight tile registers of a 2 x 2 block product: a0, a1, b0, b1, c00 .. c11."""
    return {name: tiles.new(name) for name in ("a0", "a1", "b0", "b1", "c00", "c01", "c10",
                                               "c11")}


def block_product(f: Fn, tiles: Tiles, regs: dict, a_at, a_stride, b_at, b_stride, c, ldc: int,
                  kcp, first, int8: bool | str = False, row_tiles: int = 2, side=None,
                  side_rest=None, b_ahead: int = 0, b_once: bool = False,
                  col_tiles: int = 2) -> None:
    """A 32 x 32 float32 block ``C (+)= A B`` over ``kcp`` k pairs (a multiple of ``STEP``):
    2 x 2 accumulators from zero (``first``, an i1) or loaded from ``c`` (row stride ``ldc``
    floats), stored back whole. ``int8``: u8 A x s8 B words (4 k each) into int32 sums
    (``"s8u8"``: s8 A x u8 B).
    ``row_tiles`` 1: a 16 x 32 block (two accumulators, one A tile a step); ``col_tiles`` 1: a
    32 x 16 block (one B tile a step; with ``b_ahead`` 0). ``side(step)``:
    vector work emitted in each step (its index, i64) after the first product, and
    ``side_rest(steps)`` after the last (the pending epilogue). ``a_at(k, i)`` /
    ``b_at(k, j)``: the address of A tile ``i`` (rows 16 i ..) / B tile ``j`` (columns 16 j ..)
    at pair ``k``; ``a_stride`` / ``b_stride`` their row strides in bytes (i64 values).
    ``b_ahead``: B prefetched that many bytes on; ``b_once``: B read once here, its tiles
    loaded around L1 and prefetched into L2 only, so that A stays in L1 (module doc)."""
    b = f.b
    assert col_tiles == 2 or not b_ahead
    acc = [[regs["c00"], regs["c01"]][:col_tiles],
           [regs["c10"], regs["c11"]][:col_tiles]][:row_tiles]
    ldc_bytes = const(i64, ldc * 4)

    def c_at(i, j):
        return simd.gep(b, c, const(i64, i * 16 * ldc + j * 16))

    with f.if_else(first) as (from_zero, from_c):
        with from_zero:
            for row in acc:
                for t in row:
                    tiles.zero(t)
        with from_c:
            for i, row in enumerate(acc):
                for j, t in enumerate(row):
                    tiles.load(t, c_at(i, j), ldc_bytes)
    dot = tiles.dot_s8u8 if int8 == "s8u8" else tiles.dot_u8s8 if int8 else tiles.dot_bf16

    with f.for_range(0, kcp, step=STEP, name="kstep") as k:
        def between() -> None:   # after the step's first product
            if side is not None:
                side(b.lshr(k, const(i64, 4)))
            if b_ahead:  # the step's 16 rows of B (both tiles), ``b_ahead`` bytes on
                fetch = simd.prefetch_l2 if b_once else simd.prefetch
                for line in range(0, 16 * B_ROW_BYTES, 64):
                    fetch(b, simd.gep(b, b_at(k, 0), const(i64, b_ahead + line), i8))

        tile_step(tiles, regs, acc, [dot] * row_tiles, lambda i: a_at(k, i), a_stride,
                  lambda j: b_at(k, j), b_stride, b_once, between)
    if side_rest is not None:
        side_rest(b.lshr(kcp, const(i64, 4)))
    for i, row in enumerate(acc):
        for j, t in enumerate(row):
            tiles.store(t, c_at(i, j), ldc_bytes)


def _epilogue(f: Fn, p, block, q, rows, bias, out, res) -> None:
    """bias, activation, residual and the rounding to bf16 of ``rows`` rows of a block from
    ``block`` (row stride 32 floats) to ``out``, its valid columns (the last panel's column
    count is a compile-time edge)."""
    s, b = p.s, f.b
    col0 = b.mul(q, const(i64, s.nr))
    native = p.dot == "dpbf16"
    if p.int8 and not p.planes:  # bias holds the column scales, then the bias (module doc)
        _scale_int32(f, block, rows, simd.gep(b, bias, col0))
        col0 = b.add(col0, const(i64, p.np * s.nr))
    bias_q = simd.gep(b, bias, col0) if s.bias else None

    def run(cols: int) -> None:
        nv = -(-cols // 16)
        epilogue_rows(f, rows, nv, 16, cols - 16 * (nv - 1), block, 32, out, p.ldo,
                      s.epilogue, bias_q, res, p.out, native)

    if p.nr_edge == s.nr:
        run(s.nr)
        return
    with f.if_else(b.icmp_signed("==", q, const(i64, p.np - 1))) as (edge, full):
        with edge:
            run(p.nr_edge)
        with full:
            run(s.nr)


def _combine_planes(f: Fn, p, block, q, rows, quant, x_row0) -> ir.Value:
    """A block's int32 sums of ``rows`` plane rows (``p.planes`` per x row) combined per x row
    (gemm_lowbit_vnni.combine_planes, as the vector micro-kernel's epilogue combines them) into
    its first rows as float32, in place (x row ``g`` is written after rows ``g * planes ..``,
    all at or past it, are read); returns the x rows (an i64 value)."""
    b, count = f.b, p.planes
    heads, scale, qsum = quant
    vt = simd.vty(16)
    col0 = b.mul(q, const(i64, p.s.nr))
    scales = [simd.load_vec(b, scale, b.add(col0, const(i64, 16 * v)), 16) for v in range(2)]
    qsums = [b.sitofp(simd.load_vec(b, qsum, b.add(col0, const(i64, 16 * v)), 16, elem=i32),
                      vt) for v in range(2)]
    x_rows = b.udiv(rows, const(i64, count))
    with f.for_range(0, x_rows, name="xr") as g:
        factor = load_factor(b, simd.gep(b, heads, b.mul(b.add(x_row0, g),
                                                         const(i64, HEAD)), i8), 16)
        for v in range(2):
            sums = [b.sitofp(b.load(simd.gep(b, block, b.add(
                b.mul(b.add(b.mul(g, const(i64, count)), const(i64, i)), const(i64, 32)),
                const(i64, 16 * v)), i32), typ=I32x16, align=4), vt) for i in range(count)]
            b.store(combine_planes(b, sums, qsums[v], factor, scales[v], count),
                    simd.gep(b, block, b.add(b.mul(g, const(i64, 32)), const(i64, 16 * v))),
                    align=4)
    return x_rows


def _scale_int32(f: Fn, block, rows, scale) -> None:
    """The int32 sums of a block's first ``rows`` rows as float32 times their column's scale,
    in place (one rounding each: the conversion is exact below 2**24, then the product)."""
    b = f.b
    vt = simd.vty(16)
    scales = [simd.load_vec(b, scale, const(i64, 16 * v), 16) for v in range(2)]
    with f.for_range(0, rows, name="dq") as r:
        for v in range(2):
            at = simd.gep(b, block, b.add(b.mul(r, const(i64, 32)), const(i64, 16 * v)), i32)
            sums = b.load(at, typ=I32x16, align=4)
            b.store(b.fmul(b.sitofp(sums, vt), scales[v]), at, align=4)


def _pack_b_block(f: Fn, p, pack_b, b_mat, qb0, qb1, k0, kcl, kcp, bp) -> None:
    """Runtime B: panels [qb0, qb1) of K block ``k0`` into ``bp``, ``kcp`` k pairs apart, the
    pairs past ``kcl`` zero."""
    s, b = p.s, f.b
    nr = s.nr
    with f.for_range(qb0, qb1, name="pb") as q:
        col0 = b.mul(q, const(i64, nr))
        cols = smin(b, b.sub(const(i64, s.n), col0), const(i64, nr))
        if s.b_layout == "nk":
            src = simd.gep(b, b_mat, b.add(b.mul(col0, const(i64, p.kw)), k0), i32)
        else:  # rows 2 k0 and 2 k0 + 1 start the first pair
            src = simd.gep(b, b_mat, b.add(b.mul(b.mul(k0, const(i64, 2)), const(i64, s.n)),
                                           col0), i16)
        dst = simd.gep(b, bp, b.mul(b.sub(q, qb0), b.mul(kcp, const(i64, nr))), i32)
        b.call(pack_b, [src, cols, kcl, dst])
    _zero_pad(f, p, qb0, qb1, kcl, kcp, bp)


def _zero_pad(f: Fn, p, qb0, qb1, kcl, kcp, bp) -> None:
    """The k pairs past ``kcl`` (up to the whole step ``kcp``) of panels [qb0, qb1) in
    ``bp`` zero: the last step of a product reads them."""
    b, nr = f.b, p.s.nr
    zero = ir.Constant(I32x16, [ir.Constant(i32, 0)] * 16)
    with f.for_range(qb0, qb1, name="zq") as q:
        dst = simd.gep(b, bp, b.mul(b.sub(q, qb0), b.mul(kcp, const(i64, nr))), i32)
        with f.for_range(kcl, kcp, name="pz") as r:
            for v in range(nr // 16):
                b.store(zero, simd.gep(b, dst, b.add(b.mul(r, const(i64, nr)),
                                                    const(i64, 16 * v)), i32), align=4)


def emit_pad_rows(module: ir.Module, kw: int, kwp: int) -> ir.Function:
    """``void pad_rows(ptr src, i64 rows, ptr dst)``: rows of ``kw`` words into rows of ``kwp``
    (whole tile steps), zero past ``kw``: A tiles are read from there in place."""
    name = f"pad_rows.{kw}.{kwp}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr], ["src", "rows", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, dst = f.args
    b = f.b
    load = intrinsic(module, "llvm.masked.load.v16i32.p0", I32x16,
                     [ptr, i32, ir.VectorType(i1, 16), I32x16])
    zero = ir.Constant(I32x16, [ir.Constant(i32, 0)] * 16)
    with f.for_range(0, rows, name="r") as r, f.for_range(0, kwp, step=STEP, name="w") as w:
        mask = simd.lane_mask(b, 16, b.sub(const(i64, kw), w))
        word = simd.gep(b, src, b.add(b.mul(r, const(i64, kw)), w), i32)
        out = simd.gep(b, dst, b.add(b.mul(r, const(i64, kwp)), w), i32)
        b.store(b.call(load, [word, const(i32, 4), mask, zero]), out, align=4)
    return f.finish()


def emit_pack_a_tiles(module: ir.Module, kw: int, block_rows: int = 32,
                      src_step: int = STEP, planes_apart: bool = False) -> ir.Function:
    """``void pack_a_tiles(ptr src, i64 rows, i64 kcl, ptr dst)``: rows ``[0, rows)`` x ``kcl``
    k pairs of A (row stride ``kw`` words), ``block_rows`` (at most 32) at a time, into blocks
    of 32 rows: per step of 16 pairs, rows 0-15 then 16-31, 16 words each (two A tiles, 1 KB
    apart); rows past ``rows`` or ``block_rows`` and pairs past ``kcl`` zero, up to whole
    blocks and steps. Step by step, each step's 2 KB written in
    order (row by row, with steps inside, the stores went 2 KB apart: 128 x 384 x 1536 on 2
    threads 1274 -> 1672 GFLOP/s on Emerald Rapids). ``src_step`` 8: each step holds 8 words
    of A and 8 zero (a group of the grouped int4 product, gemm_tile_grouped.py).
    ``planes_apart``: A's rows are pairs (an x row's two planes), a block's even rows go to its
    first tile and odd ones to its second (row ``r`` to ``16 (r % 2) + r // 2``), so that each
    tile holds one plane of 16 x rows."""
    name = f"pack_a_tiles.{kw}" + (f".{block_rows}" if block_rows != 32 else "") + \
        (f".s{src_step}" if src_step != STEP else "") + (".apart" if planes_apart else "")
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, i64, ptr], ["src", "rows", "kcl", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, kcl, dst = f.args
    b = f.b
    spread = STEP // src_step    # words of a packed step per word of A
    kcp = b.mul(b.and_(b.add(kcl, const(i64, src_step - 1)), const(i64, -src_step)),
                const(i64, spread))
    load = intrinsic(module, "llvm.masked.load.v16i32.p0", I32x16,
                     [ptr, i32, ir.VectorType(i1, 16), I32x16])
    zero = ir.Constant(I32x16, [ir.Constant(i32, 0)] * 16)

    def place(r):
        """The tile row of a block's row ``r``."""
        if not planes_apart:
            return r
        return b.add(b.mul(b.and_(r, const(i64, 1)), const(i64, 16)), b.lshr(r, const(i64, 1)))

    with f.for_range(0, b.sdiv(b.add(rows, const(i64, block_rows - 1)),
                               const(i64, block_rows)), name="blk") as blk:
        row0 = b.mul(blk, const(i64, block_rows))
        real = smin(b, b.sub(rows, row0), const(i64, block_rows))
        base = b.mul(blk, b.mul(kcp, const(i64, 32)))
        with f.for_range(0, kcp, step=STEP, name="s") as k:
            step0 = b.add(base, b.mul(k, const(i64, 32)))
            ks = b.udiv(k, const(i64, spread))   # A's word at the step
            mask = simd.lane_mask(b, 16, smin(b, b.sub(kcl, ks), const(i64, src_step)))
            with f.for_range(0, real, name="r") as r:
                word = simd.gep(b, src, b.add(b.mul(b.add(row0, r), const(i64, kw)), ks), i32)
                out = simd.gep(b, dst, b.add(step0, b.mul(place(r), const(i64, 16))), i32)
                b.store(b.call(load, [word, const(i32, 4), mask, zero]), out, align=64)
            with f.for_range(real, 32, name="z") as r:
                b.store(zero, simd.gep(b, dst, b.add(step0, b.mul(place(r), const(i64, 16))),
                                       i32), align=64)
    return f.finish()
