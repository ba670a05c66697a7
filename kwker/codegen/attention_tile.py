"""Attention's two products on matrix tiles: bf16 S = Q K^T and O += P V on ``tdpbf16ps``.

The tile form of the bf16 k-pair layouts of attention_bf16.py, for CPUs with AMX (or the
emulated target): the online softmax, masks, causal skipping, GQA and threads are those of
attention.py, only the micro-kernel calls become 32 x 32 block products (gemm_tile.py):

- S: a block of 32 query rows (their pairs, ``ep_pad`` words a row) times a 32-key K panel
  (``ep_pad`` word rows of 32 keys): A tiles are Q rows, B tiles panel rows; ``ep_pad`` is
  ``e / 2`` rounded up to 16 words with both operands zero past it, so the contraction is
  whole tile steps (``e`` = 80: three steps, the last half zeros). The scores of all 32 rows
  are stored into the S buffer; the softmax reads only the block's real rows and keys.
- O: P rounded to bf16 over the first half of its own S row (pairs of keys, ``bk`` words
  apart) times V packed in key pairs (rows of ``ev_pad`` words), per 32 output columns and a
  last 16 (``ev`` = 80), accumulated into the float32 O buffer (zero on the first key block).
  Whole steps of 16 key pairs run on tiles; the rest of a partial last block goes to the
  vector micro-kernel, so no P or V past the block's keys is ever read (a 0 in P times an inf
  in V would be NaN).

Taken for bf16 with ``e == ev``, ``e`` a multiple of 16 and more than a few queries
(``tile_path_fits``); other shapes keep the vector products.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .attention_args import DIRECT_MAX_LQ
from .gemm_tile import STEP, block_product, block_registers
from .irutil import const, i1, i32, i64, ptr
from .tiles import Tiles


def tile_path_fits(lq: int | None, e: int, ev: int, target) -> bool:
    """Whether bf16 attention of these sizes (``lq`` None: generic) runs on tiles there."""
    return (target.tiles in ("amx", "emulated") and target.has("avx512bf16") and e == ev
            and e % 16 == 0 and (lq is None or lq > DIRECT_MAX_LQ))


class TileProducts:
    """The products of one attention body function ``em.f`` (an attention._Emitter)."""

    def __init__(self, em, mode: str):
        self.em = em
        self.tiles = Tiles(em.f, mode, em.dot)   # tile_path_fits: AVX512_BF16 is there
        self.regs = block_registers(self.tiles)

    def scores(self, qh, kp, sbuf, j0, kv) -> None:
        """S[0:32, 0:kv] of the key block at ``j0``; ``qh``: the block's Q pairs."""
        em = self.em
        f, b, ep, ld = em.f, em.f.b, em.ep_pad, em.q_ld   # (module doc)
        first = const(i1, 1)
        with f.for_range(0, b.sdiv(b.add(kv, const(i64, 31)), const(i64, 32)), name="tp") as p:
            col = b.mul(p, const(i64, 32))
            panel = simd.gep(b, kp, b.mul(b.add(j0, col), const(i64, ep)), i32)
            block_product(
                f, self.tiles, self.regs,
                lambda k, i: simd.gep(b, qh, b.add(k, const(i64, i * 16 * ld)), i32),
                const(i64, ld * 4),
                lambda k, j: simd.gep(b, panel, b.add(b.mul(k, const(i64, 32)),
                                                      const(i64, j * 16)), i32),
                const(i64, 32 * 4), simd.gep(b, sbuf, col), em.ld_s, const(i64, ep), first)

    def accumulate(self, vh, sbuf, obuf, j0, kv, rows) -> None:
        """O[0:32] += P V over the key block at ``j0`` (``kv`` keys, ``vh``: V in key pairs)."""
        em = self.em
        f, b, s, ev_pad = em.f, em.f.b, em.s, em.ev_pad
        pairs = b.sdiv(b.add(kv, const(i64, 1)), const(i64, 2))
        whole = b.and_(pairs, const(i64, -STEP))
        vb = simd.gep(b, vh, b.mul(b.sdiv(j0, const(i64, 2)), const(i64, ev_pad)), i32)
        first = b.icmp_signed("==", j0, const(i64, 0))
        for cb in range(0, ev_pad, 32):   # 32 output columns a block; the last 16 for ev = 80
            block_product(
                f, self.tiles, self.regs,
                lambda k, i: simd.gep(b, sbuf, b.add(k, const(i64, i * 16 * em.ld_s)), i32),
                const(i64, em.ld_s * 4),
                lambda k, j, cb=cb: simd.gep(b, vb, b.add(b.mul(k, const(i64, ev_pad)),
                                                          const(i64, cb + j * 16)), i32),
                const(i64, ev_pad * 4), simd.gep(b, obuf, const(i64, cb)), ev_pad,
                whole, first, col_tiles=min(2, (ev_pad - cb) // 16))
        rest = b.sub(pairs, whole)
        nullp = ir.Constant(ptr, None)

        def tail(r0, nrows):
            a = simd.gep(b, sbuf, b.add(b.mul(r0, const(i64, em.ld_s)), whole), i32)
            c = simd.gep(b, obuf, b.mul(r0, const(i64, ev_pad)))
            b.call(em.o_kernel(nrows), [a, simd.gep(b, vb, b.mul(whole, const(i64, ev_pad)),
                                                    i32), c, rest, const(i64, 0), nullp, nullp,
                                        nullp])

        with f.if_(b.icmp_signed(">", rest, const(i64, 0))):
            em._row_tiles(rows, s.mro, tail)
