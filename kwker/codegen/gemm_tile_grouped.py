"""int4 weights in groups of 32 k on int8 tiles, exact to float32: the grouped byte planes.

The float32 prefill of int4 weights scales each group of 32 k by its own scale, so its int32
sums cannot run over K as int8's per-channel sums do (gemm_tile.py's ``planes``): they restart
every group, one ``tdpbusd`` step per accumulator tile. After the step the four accumulators
are stored (4 KB, L1) and each x row's planes combined as the vector micro-kernel's ``_grouped``
combines them (gemm_micro.py), for planes of ``d`` bits (x's ``bits``, 24 or 16; 8-bit planes
offset by half their range, 12-bit ones not: below):

    t = S0 + 2**d S1 (+ 2**2d S2) - 2**(bits - 1) sum_k (q - zp)     (wrapping int32: exact)
    sums[x row] += float(t) * scale[group]                    (float32 FMA)

the float32 sums of a block's x rows x 32 columns living in registers across the groups of a K
block, through the block's scratch between K blocks. The last K block multiplies them by the
rows' factors into the scratch, where gemm_tile.py's epilogue takes them. Two forms:

- 8-bit planes (three; two under ``"high"``; weights with zero points): a group is 8 words of
  k quads, so its A tile holds them then 8 zero words (``emit_pack_a_tiles(src_step=8)``) and
  the B tile's rows 8-15 (the group's column sums and scales, the next group's rows) multiply
  zeros. A block takes 10 x rows (three planes).
- 12-bit planes (two, as exact as three of 8; symmetric weights): a plane's digit ``d`` of each
  k is two bytes, ``d & 15`` and ``d >> 4``, and the weights' bytes ``(q, 16 q)`` (``16 q`` fits
  s8 for q in [-8, 7]), so a word of two k sums ``d q`` over both and a group is a full tile
  step of 16 words. A block takes 16 x rows with no zero products: 1.6x the rows of the 8-bit
  form per tile step and store. Emerald Rapids, 128 rows, 2 threads, in one process: GPT-2's
  linears 49.4 -> 43.2 ms (2304 x 768 1.99 -> 1.76), GPT-2's prefill 183 -> 143 ms. The digits
  are x's own, not offset: the low one unsigned (``tdpbusd``), the high one signed, its ``d >>
  4`` an s8 byte (``tdpbssd``); packed A puts each plane in a tile of its own (``planes_apart``)
  and the combine is ``S0 + 2**12 S1``: 4 vector instructions a row's 16 columns (8-bit: 7),
  and no column sums in the panels (2304 x 768, 128 rows: 0.96-1.01 -> 0.76-0.87 ms against
  the offset form, alternating processes).

Scales per 64 or 128 k (or more; torchao's int4 default is 128): with 12-bit planes a run of the
scale's groups (``run_steps``: 2 or 4) sums in the tiles before one store and combine. The
combined sum of 128 k can pass int32, so a run combines in float32 instead, ``2**12 S1 + S0``
in one FMA (each plane's sum below 2**23, so exact before that one rounding, as ``float(t)``
rounds the int32 ``t`` of one group). Emerald Rapids, 128 rows, 2 threads, in one process,
scales per 128 k against the same weights combined per 32 k: 2304 x 768 0.84 -> 0.60 ms, 768 x
3072 1.23 -> 0.98, 3072 x 768 1.12 -> 0.79, 768 x 768 0.31 -> 0.22 (eager bf16: 0.28, 0.40,
0.37, 0.10).
8-bit planes keep a combine per group (their wrapping int32 form).

Against the float32 FMAs of dequantised weights (the path before, exact to the same error) the
12-bit form measured 1.41x on GPT-2's linears (60.9 -> 43.2 ms) and 1.35x on its prefill (192
-> 143; eager bf16 104 in that run). Where a call's time goes (2304 x 768, 128 rows, 2 threads,
parts switched off in turn): outside the groups' loop 37% (the per-call unpacking of the panels
~20%), tile products 21% (the bf16 GEMM's ~18.6 cycles a step), the groups' tile stores 18%,
the combine 23%, adding up: the tile unit and the vector code do not overlap. A sub-block's
products before its combines, stores issued a column half later, and running sums without
``tilezero`` all measured level.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd, vmath
from .gemm_lowbit_vnni import GROUP_QUADS, GROUP_ROWS, HEAD, load_factor
from .irutil import Fn, const, i8, i32, i64
from .tiles import tile_step


def group_rows(plane_bits: int = 8) -> int:
    """Rows of ``nr`` words a group of 32 k takes in a grouped panel (gemm_lowbit_planes.py):
    its weights (8 rows of k quads; for 12-bit planes 16 rows of k pairs as ``(q, 16 q)``
    bytes), then the columns' sums of ``q - zp`` (8-bit planes only: 12-bit ones carry x's
    digits without an offset) and their scales."""
    return GROUP_ROWS if plane_bits == 8 else GROUP_ROWS + 7


def group_words(plane_bits: int = 8) -> int:
    """Words of A a group of 32 k takes: 8 k quads (8-bit planes), or 16 words of two k."""
    return GROUP_QUADS if plane_bits == 8 else 2 * GROUP_QUADS


def a_spread(plane_bits: int = 8) -> int:
    """Words of packed A a word of A takes: 2 for 8-bit planes (a group's 8 words, then 8 zero
    filling its tile step), else 1."""
    return 2 if plane_bits == 8 else 1


def run_steps(b_group: int, plane_bits: int) -> int:
    """Tile steps (groups of 32 k) whose int32 sums run on before one store and combine, for
    scales per ``b_group`` k: with 12-bit planes the most of 4, 2 or 1 that divides ``b_group
    // 32`` (each plane's sums over 128 k stay below 2**23, exact in float32), else 1 (8-bit
    planes combine in wrapping int32, whose exact sum of 32 k is the most it holds)."""
    if plane_bits != 12:
        return 1
    return next(t for t in (4, 2, 1) if b_group // 32 % t == 0)


I32x16 = ir.VectorType(i32, 16)
A_GROUP_WORDS = 32 * 16   # a group of a packed 32-row A block: two tiles of 16 rows x 16 words
# rows an 8-bit grouped panel's last group's B tiles read past it (its 10 rows of 16)
B_TAIL_ROWS = 16 - GROUP_ROWS


def grouped_product(f: Fn, p, tiles, regs, a_tile, b_panel, groups, first, last, block, gbuf,
                    quant, x_row0, x_rows) -> None:
    """One block of C over ``groups`` groups of a K block (module doc): A from its packed row
    tile (``A_GROUP_WORDS`` a group), B from its grouped panel at the block's first group (rows
    ``nr`` words apart), the int32 tiles through ``gbuf`` (32 x 32 words); ``first`` / ``last``
    (i1): the K block starts the sums from zero / ends them, leaving the block's ``x_rows`` (an
    i64) valid rows times their factors in ``block`` rows 0 .., else the partial sums there.
    ``quant``: the x rows' heads, from x row ``x_row0``."""
    b, nr, count, digits = f.b, p.s.nr, p.planes, p.s.plane_bits
    rows = p.a_rows // count
    b_rows = group_rows(digits)   # of a group in the grouped panel
    vt = simd.vty(16)
    stride = const(i64, 32 * 4)   # of gbuf and block rows, in bytes
    sums = [[f.var(vt, None, f"gsum_{r}_{v}") for v in range(2)] for r in range(rows)]
    with f.if_else(first) as (from_zero, from_block):
        with from_zero:
            for row in sums:
                for v in row:
                    v.set(vmath.splat(vt, 0.0))
        with from_block:
            for r, row in enumerate(sums):
                for v, var in enumerate(row):
                    var.set(simd.load_vec(b, block, const(i64, r * 32 + 16 * v), 16))
    acc = [[regs["c00"], regs["c01"]], [regs["c10"], regs["c11"]]]
    a_stride, b_stride = const(i64, 64), const(i64, nr * 4)

    def shl(x, bits: int):
        return b.shl(x, ir.Constant(I32x16, [bits] * 16))

    twelve = digits == 12
    # 12-bit planes: the second tile holds the x rows' signed high digits (x's digits, no
    # offset; packed A tiles hold one plane each)
    high = tiles.dot_s8s8 if twelve else tiles.dot_u8s8

    def products(g, steps: int) -> None:
        """The tile steps of groups ``g .. g + steps`` (of 32 k, one scale) summed in the four
        int32 tiles, which are then stored to ``gbuf``."""
        for row in acc:
            for t in row:
                tiles.zero(t)
        for j in range(steps):
            gj = b.add(g, const(i64, j))
            a_at = simd.gep(b, a_tile, b.mul(gj, const(i64, A_GROUP_WORDS)), i32)
            b_at = simd.gep(b, b_panel, b.mul(gj, const(i64, b_rows * nr)), i32)
            tile_step(tiles, regs, acc, [tiles.dot_u8s8, high],
                      lambda i, a_at=a_at: simd.gep(b, a_at, const(i64, 256 * i), i32), a_stride,
                      lambda j, b_at=b_at: simd.gep(b, b_at, const(i64, 16 * j), i32), b_stride)
        for i, row in enumerate(acc):
            for j, t in enumerate(row):
                tiles.store(t, simd.gep(b, gbuf, const(i64, i * 16 * 32 + j * 16), i32), stride)

    def combine(g, steps: int) -> None:
        """The int32 tiles of groups ``g .. g + steps`` from ``gbuf`` into the float sums. 8-bit
        planes (rows ``count`` a x row, offset by half of x's range): ``S0 + 2**8 S1 (+ 2**16
        S2)`` less the offset, in wrapping int32 (exact: the sum of 32 k fits). 12-bit planes
        (x row ``r``'s low digits in row ``r``, its high ones in row ``16 + r``, no offset):
        ``S0 + 2**12 S1``, in int32 for one group, for a run (whose sum may pass int32) in one
        float32 FMA, each plane's sum below 2**23: exact before its one rounding either way."""
        b_at = simd.gep(b, b_panel, b.mul(g, const(i64, b_rows * nr)), i32)
        for v in range(2):
            scale = simd.load_vec(b, b_at, const(i64, (b_rows - 1) * nr + 16 * v), 16)
            if not twelve:
                offset = shl(simd.load_vec(b, b_at, const(i64, (b_rows - 2) * nr + 16 * v), 16,
                                           elem=i32), digits * count - 1)
            for r in range(rows):
                at = [r + 16 * i if twelve else r * count + i for i in range(count)]
                planes = [simd.load_vec(b, gbuf, const(i64, row * 32 + 16 * v), 16, elem=i32)
                          for row in at]
                if steps > 1:
                    t = vmath.fma(b, b.sitofp(planes[1], vt), vmath.splat(vt, float(1 << digits)),
                                  b.sitofp(planes[0], vt))
                else:
                    t = planes[0]
                    for i in range(1, count):
                        t = b.add(t, shl(planes[i], digits * i))
                    t = b.sitofp(t if twelve else b.sub(t, offset), vt)
                sums[r][v].set(vmath.fma(b, t, scale, sums[r][v].get()))

    # runs of ``steps`` groups of one scale (b_group // 32, K blocks aligned to them), then
    # any groups left one at a time
    steps = run_steps(p.s.b_group, digits)
    runs = b.udiv(groups, const(i64, steps)) if steps > 1 else groups
    with f.for_range(0, runs, name="run") as run:
        g = b.mul(run, const(i64, steps))
        products(g, steps)
        combine(g, steps)
    if steps > 1:
        with f.for_range(b.mul(runs, const(i64, steps)), groups, name="grp") as g:
            products(g, 1)
            combine(g, 1)

    heads = quant[0]
    with f.if_else(last) as (done, partial):
        with done:
            for r, row in enumerate(sums):
                with f.if_(b.icmp_signed(">", x_rows, const(i64, r))):
                    head = simd.gep(b, heads, b.mul(b.add(x_row0, const(i64, r)),
                                                    const(i64, HEAD)), i8)
                    factor = load_factor(b, head, 16)
                    for v, var in enumerate(row):
                        simd.store_vec(b, b.fmul(var.get(), factor), block,
                                       const(i64, r * 32 + 16 * v))
        with partial:
            for r, row in enumerate(sums):
                for v, var in enumerate(row):
                    simd.store_vec(b, var.get(), block, const(i64, r * 32 + 16 * v))
