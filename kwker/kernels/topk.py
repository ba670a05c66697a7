"""``make_linear_topk``: fused ``torch.topk(x @ W.T, k)`` with W packed once at build time."""
from __future__ import annotations

import math

import torch

from ..codegen.gemm_bf16 import bound_factor
from ..runtime.target import host_target
from . import blocking
from ._call import _profiler_enabled, checked, entry, kernel_dtype, record_function, require_f32
from .linear import make_linear, pack_bf16_panels, pack_panels
from .specs import TopkGemmSpec

MIN_BF16_K = 32  # below this the float32 rescoring of survivors costs more than screening saves


def _tile(m: int, bf16: bool) -> tuple[int, int]:
    lanes = blocking.lanes()
    if bf16:
        return (8, 48) if m >= 8 else (m, 64 if m <= 4 else 48)
    if lanes == 16:
        if m >= 8:
            return 8, 48
        return m, 64 if m <= 4 else 48
    return (min(m, 6), 16) if m > 3 else (m, 24)


def _bounds(w: torch.Tensor) -> torch.Tensor:
    """e_j = c |w_j|, rounded up: how far a bf16 score may be from the float32 one per |q|."""
    norms = torch.linalg.vector_norm(w.detach().double(), dim=1)
    e = (norms * bound_factor(w.shape[1]) * (1 + 2.0 ** -20)).float()
    return torch.nextafter(e, torch.full_like(e, math.inf)).contiguous()


def make_linear_topk(weight_rows: torch.Tensor, m: int, k: int, largest: bool = True,
                     screen: bool | None = None, dtype: torch.dtype | None = None):
    """``callable(x (m, K)) -> (values (m, k), indices int64 (m, k))`` of ``x @ weight_rows.T``.

    Values are sorted best first; indices are those ``torch.topk`` gives on the same scores (its
    heap path, ``k * 64 <= N``; for larger k the scores go through ``torch.topk`` itself).
    ``screen`` (default: when the CPU has AVX512_BF16 and K >= 32) computes float32 scores in
    bf16 at twice the rate and rescores in float32 the few that could enter a heap (exact
    bound). ``dtype=torch.bfloat16`` (default: the weight's): bf16 x, weights rounded to bf16,
    scores rounded to bf16 exactly as ``make_linear`` rounds them, and the top-k of those.
    """
    dtype = dtype or weight_rows.dtype
    if kernel_dtype(dtype, "make_linear_topk") == "bf16":
        return _make_bf16(weight_rows, int(m), int(k), bool(largest))
    require_f32(weight_rows, what="make_linear_topk")
    if weight_rows.dim() != 2:
        raise ValueError(f"make_linear_topk: weight_rows must be (N, K), "
                         f"got {tuple(weight_rows.shape)}")
    n, kd = weight_rows.shape
    m, k = int(m), int(k)
    if not 0 < k <= n or m < 1:
        raise ValueError(f"make_linear_topk: need 0 < k <= N and m >= 1, got k={k}, N={n}, m={m}")
    if k * 64 > n:  # ATen's introselect path: exact order needs its own emulation
        scores = make_linear(weight_rows, None, m)

        def via_topk(x):
            return torch.topk(scores(x), k, dim=-1, largest=largest)
        via_topk.spec = scores.spec
        return via_topk
    target = host_target()
    can_screen = target.has("avx512bf16") and blocking.lanes(target) == 16
    if screen is None:
        screen = can_screen and kd >= MIN_BF16_K
    elif screen and not can_screen:
        raise NotImplementedError("make_linear_topk: bf16 screening needs AVX512_BF16")
    mr, nr = _tile(m, screen)
    spec = TopkGemmSpec(m, n, kd, k, bool(largest), mr, nr, "bf16" if screen else "none")
    fn = entry(spec, 6)
    w32 = weight_rows.detach().to(torch.float32).contiguous()
    if screen:
        packed, exact, evec = pack_bf16_panels(w32, nr), w32, _bounds(w32)
    else:
        packed, exact, evec = pack_panels(w32, nr), None, None
    w_ptr, symbol = packed.data_ptr(), spec.symbol
    wx_ptr = exact.data_ptr() if exact is not None else None
    e_ptr = evec.data_ptr() if evec is not None else None
    x_shape, out_shape = (m, kd), (m, k)
    f32, i64, empty, threads = torch.float32, torch.int64, torch.empty, torch.get_num_threads

    def run(x: torch.Tensor):
        if not (x.shape == x_shape and x.dtype == f32 and x.is_contiguous()):
            x = checked(x, x_shape, "linear_topk input")
        vals = empty(out_shape, dtype=f32)
        idx = empty(out_shape, dtype=i64)
        if _profiler_enabled():
            with record_function(symbol):
                fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), wx_ptr, e_ptr,
                   threads())
        else:
            fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), wx_ptr, e_ptr, threads())
        return vals, idx

    run.spec, run.buffers = spec, (packed, exact, evec)  # keep the buffers alive
    return run


def _make_bf16(weight_rows: torch.Tensor, m: int, k: int, largest: bool):
    """The bf16 form of make_linear_topk (see there)."""
    if weight_rows.dim() != 2:
        raise ValueError(f"make_linear_topk: weight_rows must be (N, K), "
                         f"got {tuple(weight_rows.shape)}")
    n, kd = weight_rows.shape
    if not 0 < k <= n or m < 1:
        raise ValueError(f"make_linear_topk: need 0 < k <= N and m >= 1, got k={k}, N={n}, m={m}")
    bf16 = torch.bfloat16
    if k * 64 > n:  # ATen's introselect path: the scores go through torch.topk itself
        scores = make_linear(weight_rows, None, m, dtype=bf16)

        def via_topk(x):
            return torch.topk(scores(x), k, dim=-1, largest=largest)
        via_topk.spec = scores.spec
        return via_topk
    target = host_target()
    mr, nr = _tile(m, False)
    if blocking.lanes(target) == 8:
        mr = min(mr, 4)  # widened pairs: 2 float32 vectors per B vector (see blocking.py)
    kk = kd + kd % 2  # k pairs: an odd K gets one zero column
    spec = TopkGemmSpec(m, n, kk, k, largest, mr, nr, "none", "bf16")
    fn = entry(spec, 6)
    packed = pack_bf16_panels(weight_rows, nr)
    w_ptr, symbol = packed.data_ptr(), spec.symbol
    x_shape, out_shape = (m, kd), (m, k)
    i64, empty, threads = torch.int64, torch.empty, torch.get_num_threads

    def run(x: torch.Tensor):
        if not (x.shape == x_shape and x.dtype == bf16 and x.is_contiguous()):
            x = checked(x, x_shape, "linear_topk input", bf16)
        if kk != kd:
            x = torch.nn.functional.pad(x, (0, 1))
        vals = empty(out_shape, dtype=bf16)
        idx = empty(out_shape, dtype=i64)
        if _profiler_enabled():
            with record_function(symbol):
                fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), None, None, threads())
        else:
            fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), None, None, threads())
        return vals, idx

    run.spec, run.buffers = spec, (packed,)
    return run
