"""GEMM blocking for this CPU: register tile from the ISA, cache blocks from the cache sizes.

The register tile (mr x nr) fills the vector register file with accumulators: 12 x 32 on AVX-512
(24 zmm accumulators + 2 B vectors + 1 broadcast of 32 registers), 6 x 16 on AVX2 (12 of 16 ymm).
Cache blocks follow BLIS: an A micro-panel (mr x kc) in half of L1, a B block (nb panels x kc) in
half of L2, an A chunk (mc x kc) in a quarter of L2 (on the tiles, larger chunks where B
outgrows L2: ``tile_blocking``). Small M (<= 8 rows) gets the decode schedule: one tile of all
rows, wide panels, K unblocked, split accumulators when rows are few.

bf16 GEMMs are blocked in k pairs (one 32-bit word per pair, so every byte count below holds).
Where the CPU has no ``vdpbf16ps`` the micro-kernel widens each B vector into two float32
vectors, so its tiles leave room for those (``WIDEN_TILES``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

from ..codegen.bf16 import native as native_bf16
from ..codegen.gemm_tile import STEP as TILE_K_STEP
from ..codegen.gemm_tile import TILE_BLOCK, VECTOR_ROWS
from ..runtime.target import Target, host_target

SMALL_M = 8
# the tile path (codegen/gemm_tile.py) from this many rows up; fewer (decode sizes) stay on the
# vector path
TILE_MIN_ROWS = VECTOR_ROWS + 1
TILE_KC = 1024  # k pairs in one block at most
# the tile path's chunks of rows where B outgrows L2: rows at most, and bytes of a chunk's packed
# A and partial sums at most (tile_blocking)
BIG_CHUNK, CHUNK_BYTES = 1024, 24 << 20
# register tiles (rows, vectors): 24 accumulators of 32 zmm / 12 of 16 ymm; first = preferred
TILES = {16: [(12, 2), (8, 3), (6, 4)], 8: [(6, 2), (4, 3)], 4: [(6, 2), (4, 3)]}
# bf16 widened to float32: 2 vectors per B vector and per broadcast (30 of 32 zmm, 14 of 16 ymm)
WIDEN_TILES = {16: [(12, 2), (8, 3)], 8: [(4, 2)], 4: [(4, 2)]}


@functools.lru_cache(maxsize=None)
def cache_sizes() -> tuple[int, int, int]:
    """(L1d, L2, L3) bytes from sysfs; Zen-like defaults when it is not readable."""
    sizes = {1: 32 << 10, 2: 1 << 20, 3: 32 << 20}
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for idx in root.glob("index*"):
            kind = (idx / "type").read_text().strip()
            if kind == "Instruction":
                continue
            level = int((idx / "level").read_text())
            text = (idx / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            sizes[level] = int(text.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    return sizes[1], sizes[2], sizes[3]


@dataclass(frozen=True)
class Blocking:
    mr: int
    nr: int
    kc: int
    mc: int
    nb: int
    a_pack: bool
    ksplit: int = 1
    unroll: int = 1
    path: str = "vector"

    def as_kwargs(self) -> dict:
        return dict(mr=self.mr, nr=self.nr, kc=self.kc, mc=self.mc, nb=self.nb,
                    a_pack=self.a_pack, ksplit=self.ksplit, unroll=self.unroll, path=self.path)

    @property
    def k_step(self) -> int:
        """Pre-packed panels hold K (in k words) rounded up to this: whole tile steps."""
        return TILE_K_STEP if self.path == "tile" else 1


def lanes(target: Target | None = None) -> int:
    target = target or host_target()
    return max(4, target.vector_bits // 32)


def widens_bf16(target: Target | None = None) -> bool:
    """Whether bf16 products are widened to float32 FMAs here (no ``vdpbf16ps``): as fast as
    float32 ones at best."""
    return not native_bf16(target or host_target())


def tiles_bf16(target: Target | None = None) -> bool:
    """Whether bf16 products run on tiles here (AMX-BF16, or emulated): many times float32
    FMAs' speed (Emerald Rapids: 2284 against 177 GFLOP/s a thread)."""
    return bool((target or host_target()).tiles)


def fast_bf16(target: Target | None = None) -> bool:
    """Whether bf16 products run faster than float32 ones here: ``vdpbf16ps`` or bf16 tiles
    (AMX, or emulated)."""
    return tiles_bf16(target) or not widens_bf16(target)


def choose(m: int | None, n: int, k: int, target: Target | None = None,
           small_ok: bool = True, b_layout: str = "packed", dtype: str = "f32") -> Blocking:
    """Blocking for an (m, k) x (k, n) product on ``target`` (default: this machine); for
    ``dtype="bf16"`` ``k`` counts k pairs and a runtime B is always packed.

    ``b_layout`` is the B operand's layout (packed, kn or nk, see GemmSpec): a runtime
    row-major B read in place by the small-M schedule gets wide panels, so each k step reads
    a long contiguous run of its row instead of hopping between rows.
    """
    target = target or host_target()
    L = lanes(target)
    regs = 32 if L == 16 else 16
    l1, l2, _ = cache_sizes()
    widen = dtype == "bf16" and widens_bf16(target)
    if dtype == "bf16" and b_layout == "kn":
        b_layout = "nk"  # packed at run time, like a transposed B
    tiles = WIDEN_TILES[L] if widen else TILES[L]
    if dtype == "bf16" and target.tiles and (m is None or m >= TILE_MIN_ROWS):
        return tile_blocking(n, k, l2)
    if m is None:
        m, small_ok = 1 << 16, False   # tiles chosen by their padding along N only
    if small_ok and m <= SMALL_M:
        # accumulators m * nv * ksplit within the register file, leaving room for B and A
        budget = regs - 6 if L == 16 else regs - 4
        if widen:
            budget -= 4
        if b_layout == "kn":
            nv, ksplit = max(1, min(16, budget // m, _cdiv(n, L))), 1
        else:
            nv = max(1, min(4 if L == 16 else 3, budget // m))
            # at least two panels where N allows, so a second thread has weights to stream
            nv = max(1, min(nv, _cdiv(n, 2 * L)))
            ksplit = max(1, min(4, budget // (m * nv)))
            ksplit = 1 << (ksplit.bit_length() - 1)
        nr = nv * L
        nb = max(1, min(_cdiv(n, nr), (l2 // 2) // (nr * k * 4)))
        return Blocking(m, nr, k, m, nb, False, ksplit)
    mr, nv = least_padded(m, n, tiles, L)
    nr = nv * L
    if b_layout != "packed" and _cdiv(n, nr) <= 2:
        # one or two panels: each A row is used once or twice, packing it would cost as much
        # as the product; broadcast from A in place, K unblocked
        return Blocking(mr, nr, k, mr, 2, False)
    kc_max = _kc_in_l1(mr, l1)
    if dtype == "bf16" and k <= (l1 * 3 // 4) // (mr * 4):
        # a second K block costs bf16 a float32 round trip of the partial sums through a
        # scratch (C cannot hold them): the A micro-panel may fill 3/4 of L1 to keep K <= 1024
        # in one block (measured 1024x3072x768: 170 -> 223 GFLOP/s per thread); larger K
        # keeps the float32 blocking (4096^3: 204 GFLOP/s, 189 with 3/4-L1 blocks)
        kc_max = k
    kc = _equal_k_blocks(k, kc_max)
    mc, nb = _in_l2(mr, nr, kc, l2)
    return Blocking(mr, nr, kc, mc, nb, True)


def _kc_in_l1(mr: int, l1: int) -> int:
    """The most k words (a multiple of 16) whose ``mr``-row A micro-panel fills half of L1."""
    return max(16, (l1 // 2) // (mr * 4) // 16 * 16)


def _equal_k_blocks(k: int, kc_max: int) -> int:
    """K blocks of at most ``kc_max`` words, equal (multiples of 16), not a short last one."""
    return min(k, _cdiv(_cdiv(k, _cdiv(k, kc_max)), 16) * 16)


def _in_l2(mr: int, nr: int, kc: int, l2: int) -> tuple[int, int]:
    """(mc, nb) for K blocks of ``kc`` words: a chunk of A rows in a quarter of L2, a block of
    B panels in half of it."""
    return max(mr, (l2 // 4) // (kc * 4) // mr * mr), max(1, (l2 // 2) // (nr * kc * 4))


# bf16 products of up to this many rows on a CPU with tiles are measured on both paths (the
# crossover moves with the shape and the CPU: on Emerald Rapids 4 rows were faster on the
# vector path for 3 shapes of 4, 8 rows on tiles for all 3)
TILE_OR_VECTOR_ROWS = 32


def variants(m: int | None, n: int, k: int, dtype: str = "f32",
             target: Target | None = None) -> dict[str, Blocking]:
    """The blockings worth measuring for a product, by name; the first is ``choose``'s.
    A single entry means there is nothing to measure."""
    target = target or host_target()
    first = choose(m, n, k, target, dtype=dtype)
    out = {first.path: first}
    if dtype == "f32" and m is not None and first.path == "vector" and first.a_pack:
        # A read in place (broadcast from its rows) instead of packed per call: on Zen 3 1.0-2.0x
        # faster on each of 11 shapes (2048x64x64 1.71x, 129x257x511 1.57x, 512^3 1.09x,
        # 77x768x768 1.00x; 2026-12-03), so the built-in choice on AVX2; on Zen 4 (2026-12-06,
        # 14 shapes in one process) 1.02-1.22x where A fits in L2 (256x768x768 1.09x, 512^3
        # 1.06x, 2048x64x64 1.15x) and 0.69-1.00x where it does not (1024^3 0.69x, 2048 x 1024
        # x 256 0.98x, 128 x 768 x 3072 1.00x), so the built-in choice there where A fits
        in_place = replace(first, a_pack=False)
        first_in_place = lanes(target) == 8 or m * k * 4 <= cache_sizes()[1]
        out = ({"vector, A in place": in_place, "vector": first} if first_in_place else
               {"vector": first, "vector, A in place": in_place})
        whole = _k_whole(first, k)
        if whole is not None:
            out["vector, K whole"] = whole
    if dtype == "bf16" and target.tiles and m is not None and m <= TILE_OR_VECTOR_ROWS:
        other = "vector" if first.path == "tile" else "tile"
        out[other] = (choose(m, n, k, replace(target, tiles=""), dtype=dtype)
                      if other == "vector" else tile_blocking(n, k))
    return out


def _k_whole(blk: Blocking, k: int) -> Blocking | None:
    """``blk`` with K in one block, where it had several and one panel of it fits half of L2:
    the A micro-panel outgrows half of L1, but no partial sum goes through C between K blocks.
    On Zen 5 (48 KB L1, 1 MB L2; 2 threads, one process) it won on each of 6 shapes: 1024^3
    444 -> 474 GFLOP/s, 512 x 3072 x 768 384 -> 438, 256 x 1024 x 1536 363 -> 440, 64 x 4096 x
    1024 308 -> 411; measured per CPU, not assumed (Zen 4's blocking keeps K blocks)."""
    l2 = cache_sizes()[1]
    if blk.kc >= k or k * blk.nr * 4 > l2 // 2:
        return None
    mc, nb = _in_l2(blk.mr, blk.nr, k, l2)
    return replace(blk, kc=k, mc=mc, nb=nb)


def tile_blocking(n: int, k: int, l2: int | None = None) -> Blocking:
    """Blocks of the tile path (codegen/gemm_tile.py) for ``k`` words (bf16 pairs, int8
    quads). K stays in one block up to ``TILE_KC`` words: a 32-row A block and a B panel of that
    K each fit in a quarter of L2,
    and a second K block costs a float32 round trip of every partial sum (measured on Emerald
    Rapids, 1 thread, best of 80: 1024^3 at 460 GFLOP/s with 176-pair blocks that keep A in L1,
    1020 with K whole; 2 threads, K = 4096 in 2 blocks of 1024 pairs instead of 3 of 688:
    64 x 1024 x 4096 1008 -> 1356 GFLOP/s, 1024 x 1024 x 4096 1.63x faster, level with oneDNN;
    K = 2048 whole instead of 2 blocks: 4% faster). B blocks of ``nb`` panels in half of L2.

    Chunks of ``mc`` rows: a thread streams its B panels once per chunk, so where B outgrows
    L2 a chunk takes up to ``BIG_CHUNK`` rows (their packed A, and over several K blocks their
    partial sums, within ``CHUNK_BYTES``); where B stays in L2, the chunk's packed A takes a
    quarter of it and its partial sums half. Emerald Rapids, bf16, 2 threads, old and new in
    one process: 1024 x 3072 x 768 1.74 -> 1.62 ms (320 -> 1024 rows), 1024 x 4096 x 4096 17.8
    -> 11.9 (64 -> 1024; eager 15.8), 2048 x 4096 x 1024 5.91 -> 5.23, 1536^3 2.54 -> 2.32,
    1024 x 4096 x 1024 2.80 -> 2.38, none slower in 12 shapes; 4096 x 768 x 768 (B 1.2 MB)
    measured 3% slower with 1024-row chunks and keeps its 320."""
    l2 = l2 or cache_sizes()[1]
    mr, nr = TILE_BLOCK
    blocks = _cdiv(k, TILE_KC)
    kc = _cdiv(_cdiv(k, blocks), TILE_K_STEP) * TILE_K_STEP
    mc, nb = _in_l2(mr, nr, kc, l2)
    panels = _cdiv(n, nr)
    if panels * nr * k * 4 >= l2:   # B streams from L3 (or memory) once per chunk
        row_bytes = kc * 4 + (panels * nr * 4 if blocks > 1 else 0)
        mc = max(1, min(BIG_CHUNK, CHUNK_BYTES // row_bytes) // mr) * mr
    elif blocks > 1:   # the chunk's partial sums in half of L2 too
        mc = max(mr, min(mc, (l2 // 2) // (panels * nr * 4) // mr * mr))
    return Blocking(mr, nr, kc, mc, nb, True, path="tile")


def int8_blocking(n: int, k: int, target: Target | None = None) -> Blocking | None:
    """Blocks of the u8s8 GEMM for ``k`` words (int8 quads) on ``target``: on the tiles where it
    has AMX-INT8 (or tiles emulated), else on ``vpdpbusd`` where it has AVX-512 VNNI, else None
    (no int8 GEMM there)."""
    target = target or host_target()
    if target.tiles == "emulated" or target.tiles == "amx" and target.has("amx-int8"):
        return tile_blocking(n, k)
    if lanes(target) == 16 and target.has("avx512vnni"):
        return vnni_blocking(n, k)
    return None


def vnni_blocking(n: int, k: int, l1: int | None = None, l2: int | None = None,
                  mr: int = 12) -> Blocking:
    """Blocks of the u8s8 GEMM on the vector path (``vpdpbusd``, gemm_micro.py) for ``k`` words
    (int8 quads) against the tile path's panels of ``TILE_BLOCK[1]`` columns (2 vectors):
    ``mr`` x 2 int32 accumulators (12: 24 registers; the grouped byte planes keep float sums
    beside theirs and take fewer rows), A micro-panels in half of L1, chunks of A in a quarter
    of L2 and B blocks in half of it, as for float32."""
    sizes = cache_sizes()
    l1, l2 = l1 or sizes[0], l2 or sizes[1]
    nr = TILE_BLOCK[1]
    kc = _equal_k_blocks(k, _kc_in_l1(mr, l1))
    mc, nb = _in_l2(mr, nr, kc, l2)
    return Blocking(mr, nr, kc, mc, min(nb, _cdiv(n, nr)), True)


def least_padded(m: int, n: int, tiles: list[tuple[int, int]], L: int) -> tuple[int, int]:
    """The first (mr, vectors) tile of ``tiles`` within 3% of the least edge padding of an
    m x n product (measured: all of them reach ~90% of peak)."""
    waste = [_padded(m, n, t[0], t[1] * L) for t in tiles]
    return next(t for t, w in zip(tiles, waste) if w <= min(waste) + 0.03)


def _padded(m: int, n: int, mr: int, nr: int) -> float:
    """Work including edge-tile padding, relative to m * n (ties keep the preferred tile)."""
    return round(_cdiv(m, mr) * mr * _cdiv(n, nr) * nr / (m * n), 3)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
