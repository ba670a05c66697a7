"""``make_linear_topk``: fused ``torch.topk(x @ W.T, k)`` with W packed once at build time."""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..codegen.bf16 import native as native_bf16
from ..codegen.fused_topk import MAX_INT8_K, TOPK_TILE
from ..codegen.gemm_bf16 import bound_factor
from ..codegen.gemm_tile import STEP as TILE_K_STEP
from ..runtime.target import host_target
from . import blocking, variants
from ._call import _profiler_enabled, checked, entry, kernel_dtype, record_function, require_f32
from .linear import Packs, make_linear, pack_bf16_panels, pack_panels, shared
from .specs import TopkGemmSpec

MIN_BF16_K = 32  # below this the float32 rescoring of survivors costs more than screening saves
MAX_INT8_ROWS = 4  # up to this many rows (one row tile) the screening reads int8 weights
# CPUs LLVM knows with AVX512_VNNI (every AVX512_BF16 CPU has it; the target lists only some
# features, so the name is what tells)
VNNI_CPUS = ("cooperlake", "sapphirerapids", "emeraldrapids", "graniterapids",
             "graniterapids-d", "diamondrapids", "znver4", "znver5")


def _tile(m: int | None, n: int, bf16: bool) -> tuple[int, int]:
    """(mr, nr) for ``m`` rows of ``n`` columns; ``m=None`` (any row count): the large-m tile,
    the kernel serves the row edge with variants of every height. From 4 rows on AVX2 the GEMM
    family's tiles, least padded first: 32 rows in 4-row tiles instead of five 6-row tiles and
    a 2-row edge (x 20000 x 128, interleaved on Zen 3: 32 rows 2-4% faster, 8 rows 0.48 ->
    0.35 ms)."""
    lanes = blocking.lanes()
    big = m is None or m >= 8
    if bf16 or lanes == 16:
        return (8, 48) if big else (m, 64 if m <= 4 else 48)
    if m is None:
        return 6, 16
    if m > 3:
        mr, nv = blocking.least_padded(m, n, blocking.TILES[lanes], lanes)
        return mr, nv * lanes
    return m, 24


def _bounds(w: torch.Tensor) -> torch.Tensor:
    """e_j = c |w_j|, rounded up: how far a bf16 score may be from the float32 one per |q|;
    then max_j e_j (NaN if any is), with which the tile path screens whole rows at once."""
    norms = torch.linalg.vector_norm(w.detach().double(), dim=1)
    e = (norms * bound_factor(w.shape[1]) * (1 + 2.0 ** -20)).float()
    e = torch.nextafter(e, torch.full_like(e, math.inf))
    widest = e.max() if not e.isnan().any() else torch.tensor(math.nan)
    return torch.cat([e, widest.view(1)]).contiguous()


def _int8_pack(w: torch.Tensor, nr: int, step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 screening data of float32 (N, K) weights: panels of int32 words (panels,
    ceil(K/4) rounded up to whole ``step``s, nr), four bytes w8 + 128 per column (w8 =
    round(w / s_j) in [-127, 127], s_j = max|w_j| / 127, never subnormal; zero past N and K),
    and float32 by column (3, N): s_j, E1_j >= |w_j - s_j w8_j| and E2_j >= |s_j w8_j| (normal
    floats, rounded up), then max E1_j and max E2_j (NaN if any is: the tile path's whole-row
    screen). A row with inf or NaN or a norm past 2^60 gets E1_j = NaN: it always passes
    (codegen/topk_int8.py emit_pack_int8 has the bound)."""
    n, k = w.shape
    kq = -(-k // 4)                      # k quads, then whole steps of them
    kq, npan = -(-kq // step) * step, -(-n // nr)
    wd = w.detach().double()
    ok = torch.isfinite(wd).all(dim=1)
    wd = torch.where(ok[:, None], wd, 0.0)
    ok &= torch.linalg.vector_norm(wd, dim=1) <= 2.0 ** 60
    wd = torch.where(ok[:, None], wd, 0.0)
    s = (wd.abs().amax(dim=1) / 127).float().clamp(min=2.0 ** -100)
    w8 = (wd / s.double()[:, None]).round().clamp(-127, 127)
    what = w8 * s.double()[:, None]

    def up(e):
        e = (e * (1 + 2.0 ** -30)).clamp(min=2.0 ** -126).float()
        return torch.nextafter(e, torch.full_like(e, math.inf))
    e1 = torch.where(ok, up(torch.linalg.vector_norm(wd - what, dim=1)), math.nan)
    e2 = up(torch.linalg.vector_norm(what, dim=1))
    u8 = torch.full((npan * nr, kq * 4), 128, dtype=torch.uint8)
    u8[:n, :k] = (w8 + 128).to(torch.uint8)
    panels = u8.view(npan, nr, kq, 4).permute(0, 2, 1, 3).contiguous().view(torch.int32)
    e1, e2 = e1.float(), e2.float()
    widest = torch.stack([e1.max(), e2.max()])  # NaN if any is
    return panels.view(npan, kq, nr), torch.cat([s, e1, e2, widest]).contiguous()


def make_linear_topk(weight_rows: torch.Tensor, m: int | None, k: int, largest: bool = True,
                     screen: bool | None = None, dtype: torch.dtype | None = None,
                     source: torch.Tensor | None = None):
    """``callable(x (m, K)) -> (values (m, k), indices int64 (m, k))`` of ``x @ weight_rows.T``;
    ``m=None``: x of any number of rows (one kernel for all, the row count passed per call).

    Values are sorted best first; indices are those ``torch.topk`` gives on the same scores (its
    heap path, ``k * 64 <= N``; for larger k the scores go through ``torch.topk`` itself).
    ``screen`` (default: when the CPU has AVX512_BF16 and K >= 32) computes float32 scores in
    bf16 at twice the rate and rescores in float32 the few that could enter a heap (exact
    bound). ``dtype=torch.bfloat16`` (default: the weight's): bf16 x, weights rounded to bf16,
    scores rounded to bf16 exactly as ``make_linear`` rounds them, and the top-k of those.
    ``source``: the parameter ``weight_rows`` comes from; kernels of one source share each
    packed layout (``linear.shared``).
    """
    dtype = dtype or weight_rows.dtype
    half = kernel_dtype(dtype, "make_linear_topk") == "bf16"
    if not half:
        require_f32(weight_rows, what="make_linear_topk")
    if weight_rows.dim() != 2:
        raise ValueError(f"make_linear_topk: weight_rows must be (N, K), "
                         f"got {tuple(weight_rows.shape)}")
    n, kd = weight_rows.shape
    m, k, largest = None if m is None else int(m), int(k), bool(largest)
    if not 0 < k <= n or (m is not None and m < 1):
        raise ValueError(f"make_linear_topk: need 0 < k <= N and m >= 1 (or None), got k={k}, "
                         f"N={n}, m={m}")
    if k * 64 > n:  # ATen's introselect path: exact order needs its own emulation
        scores = make_linear(weight_rows, None, m, dtype=dtype, source=source)

        def via_topk(x):
            return torch.topk(scores(x), k, dim=-1, largest=largest)
        via_topk.spec = scores.spec
        return via_topk
    target = host_target()
    options = _paths(m, kd, half, screen, target)
    if m is None:  # one option: the vector path's generic kernel
        approx = next(iter(options.values()))[0]
        return _any_rows(weight_rows, k, largest, dtype, half, approx, target, source)
    build = {name: (lambda o=o: _build(weight_rows, m, k, largest, dtype, half, *o,
                                       source=source))
             for name, o in options.items()}
    if len(build) == 1:
        return next(iter(build.values()))()

    def inputs():
        return [torch.randn(m, kd).to(dtype)]
    problem = {"inputs": [["tensor", [m, kd], [kd, 1], str(dtype)]], "n": n, "k": k,
               "largest": largest}
    return variants.pick("linear_topk", problem, build, inputs)[1]


def _any_rows(weight_rows, k, largest, dtype, half, approx: str, target, source):
    """The kernel for any row count, from generic kernels each taking the row counts it is best
    at, as fixed row counts are served: on a CPU with tiles the tile path's from
    ``TILE_MIN_ROWS`` rows (Intel Xeon with AMX, 2 threads, 20000 x 128, k = 10, float32 with
    its bf16 screen: 32 rows 888 -> 266 us, 77 rows 2254 -> 612; bf16 32 rows 834 -> 227),
    screening with int8 where the vector path's few rows do;
    the int8 screen's up to ``MAX_INT8_ROWS`` rows, where the screen is bound by the bytes it
    reads (there, float32, alternating processes: 1 row 71-75 -> 17-18 us, 4 rows 140-146 ->
    67-69); the vector path's for the rest, and for every count where neither applies."""
    kd = weight_rows.shape[1]
    int8 = approx == "bf16" and _int8_screens(kd, target)
    tiles = bool(target.tiles) and (half or approx == "bf16")
    covered = int8 and tiles and blocking.TILE_MIN_ROWS <= MAX_INT8_ROWS + 1
    generic = functools.partial(_build, weight_rows, None, k, largest, dtype, half,
                                source=source)
    few = generic("int8", False) if int8 else None
    rest = None if covered else generic(approx, False)   # the row counts neither takes
    many = generic("int8" if int8 else approx, True) if tiles else None
    parts = [p for p in (few, rest, many) if p is not None]
    if len(parts) == 1:
        return rest
    small = MAX_INT8_ROWS if few else -1
    least = blocking.TILE_MIN_ROWS if many else 1 << 62

    def run(x: torch.Tensor):
        rows = x.shape[0] if x.dim() == 2 else 0  # another shape: the first one's checks say why
        return few(x) if rows <= small else many(x) if rows >= least else rest(x)
    run.spec, run.specs = parts[-1].spec, [p.spec for p in parts]
    run.buffers = tuple(p.buffers for p in parts)
    return run


def _int8_screens(kd: int, target) -> bool:
    """Whether the int8 screen runs here: K in its exact range, a CPU with AVX512_VNNI."""
    return kd <= MAX_INT8_K and (target.has("avx512vnni") or target.cpu in VNNI_CPUS)


def _paths(m, kd, half, screen, target) -> dict[str, tuple[str, bool]]:
    """The (screen, tiles) choices worth measuring for ``m`` rows, by name; the first is the
    built-in rule's. Screens: "none", "bf16", "int8" (float32 scores; bf16 scores have none)."""
    tiles_ok = bool(target.tiles) and m is not None
    if half:
        tiles = tiles_ok and m >= blocking.TILE_MIN_ROWS
        out = {"tile" if tiles else "vector": ("none", tiles)}
        if tiles_ok and m <= blocking.TILE_OR_VECTOR_ROWS:
            out.setdefault("vector" if tiles else "tile", ("none", not tiles))
        return out
    can_screen = native_bf16(target)
    if screen is None:
        screen = can_screen and kd >= MIN_BF16_K
    elif screen and not can_screen:
        raise NotImplementedError("make_linear_topk: bf16 screening needs AVX512_BF16")
    tiles = screen and tiles_ok and m >= blocking.TILE_MIN_ROWS
    # int8 halves the bytes the screen reads: on the vector path at few rows, on the tiles at
    # any (Intel Xeon with AMX, 2 threads, 20000 x 128, k = 10: 16 rows 160 -> 126 us, 32 rows
    # 237 -> 183, 64 rows 407 -> 332, 128 and 256 rows level); bf16 stays a candidate
    int8 = screen and m is not None and (m <= MAX_INT8_ROWS or tiles) and \
        _int8_screens(kd, target)
    approx = "int8" if int8 else "bf16" if screen else "none"
    out = {f"{approx} screen" + (" tile" if tiles else ""): (approx, tiles)}
    if int8:
        out["bf16 screen" + (" tile" if tiles else "")] = ("bf16", tiles)
    if screen and tiles_ok and m <= blocking.TILE_OR_VECTOR_ROWS:
        out.setdefault("bf16 screen", ("bf16", False))
        out.setdefault("bf16 screen tile", ("bf16", True))
    return out


def _build(weight_rows, m, k, largest, dtype, half, approx: str, tiles: bool, source=None):
    """The fused kernel with screen ``approx`` on the tile (``tiles``) or the vector path."""
    n, kd = weight_rows.shape
    target = host_target()
    if half:
        mr, nr = _tile(m, n, False)
        if blocking.lanes(target) == 8:
            mr = min(mr, 4)  # widened pairs: 2 float32 vectors per B vector (see blocking.py)
        if tiles:
            mr, nr = TOPK_TILE
        kk = kd + kd % 2  # k pairs: an odd K gets one zero column
        spec = TopkGemmSpec(m or 0, n, kk, k, largest, mr, nr, "none", "bf16",
                            path="tile" if tiles else "vector")
        step = TILE_K_STEP if tiles else 1

        def pack_half():
            return Packs([pack_bf16_panels(weight_rows, nr, step), None, None])
        return _runner(spec, lambda: shared(source, weight_rows, ("topk bf16", nr, step),
                                            pack_half), m, kd, k, dtype, pad=kk != kd)
    screen, int8 = approx != "none", approx == "int8"
    mr, nr = _tile(m, n, screen)
    if int8 and m is None:  # the generic int8 kernel: one row tile of the most rows it takes
        mr, nr = _tile(MAX_INT8_ROWS, n, screen)
    if tiles:
        mr, nr = TOPK_TILE
    spec = TopkGemmSpec(m or 0, n, kd, k, largest, mr, nr, approx,
                        path="tile" if tiles else "vector")

    step = TILE_K_STEP if tiles else 1

    def pack():
        w32 = weight_rows.detach().to(torch.float32).contiguous()
        if int8:
            panels, evec = _int8_pack(w32, nr, step)
            return Packs([panels, w32, evec])
        if screen:
            return Packs([pack_bf16_panels(w32, nr, step), w32, _bounds(w32)])
        return Packs([pack_panels(w32, nr), None, None])
    return _runner(spec, lambda: shared(source, weight_rows, ("topk", approx, nr, step), pack),
                   m, kd, k, dtype, pad=False)


def _runner(spec, pack, m: int | None, kd: int, k: int, dtype: torch.dtype, pad: bool):
    """The callable over the kernel: cheap checks, outputs, one ctypes call (``m=None``: the
    generic kernel, given the row count). ``pad``: bf16 x gets the zero column of an odd K.
    ``pack()`` makes the weight buffers, once the kernel is there (a lowering that only asks
    whether the kernel is compiled already packs nothing)."""
    fn = entry(spec, 6, 1 if m else 2)
    buffers = pack()
    w_ptr, wx_ptr, e_ptr = (t.data_ptr() if t is not None else None for t in buffers)
    symbol, what = spec.symbol, "linear_topk input"
    i64, empty, like, threads, pad_k = (torch.int64, torch.empty, torch.empty_like,
                                        torch.get_num_threads, F.pad)
    # outputs of one row (every row with a fixed m): empty_like of a template is ~0.6 us
    # cheaper per tensor than torch.empty parsing a shape and a dtype
    tv, ti = empty((m or 1, k), dtype=dtype), empty((m or 1, k), dtype=i64)

    if m is None:
        def run(x: torch.Tensor):
            if not (x.dim() == 2 and x.shape[1] == kd and x.dtype == dtype
                    and x.is_contiguous()):
                x = checked(x, (*x.shape[:1], kd), what, dtype)
            if pad:
                x = pad_k(x, (0, 1))
            rows = x.shape[0]
            if rows == 1:
                vals, idx = like(tv), like(ti)
            else:
                vals, idx = empty(rows, k, dtype=dtype), empty(rows, k, dtype=i64)
            args = (x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), wx_ptr, e_ptr, rows,
                    threads())
            if _profiler_enabled():
                with record_function(symbol):
                    fn(*args)
            else:
                fn(*args)
            return vals, idx
    else:
        x_shape = (m, kd)

        def run(x: torch.Tensor):
            if not (x.shape == x_shape and x.dtype == dtype and x.is_contiguous()):
                x = checked(x, x_shape, what, dtype)
            if pad:
                x = pad_k(x, (0, 1))
            vals, idx = like(tv), like(ti)
            if _profiler_enabled():
                with record_function(symbol):
                    fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), wx_ptr, e_ptr,
                       threads())
            else:
                fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), wx_ptr, e_ptr,
                   threads())
            return vals, idx

    run.spec, run.buffers = spec, buffers  # keep the packed weights alive
    return run
