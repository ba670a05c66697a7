"""``make_linear_topk``: fused ``torch.topk(x @ W.T, k)`` with W packed once at build time."""
from __future__ import annotations

import torch

from . import blocking
from ._call import _profiler_enabled, checked, entry, record_function, require_f32
from .linear import make_linear, pack_panels
from .specs import TopkGemmSpec


def _tile(m: int) -> tuple[int, int]:
    lanes = blocking.lanes()
    if lanes == 16:
        if m >= 8:
            return 8, 48
        return m, 64 if m <= 4 else 48
    return (min(m, 6), 16) if m > 3 else (m, 24)


def make_linear_topk(weight_rows: torch.Tensor, m: int, k: int, largest: bool = True):
    """``callable(x (m, K)) -> (values (m, k), indices int64 (m, k))`` of ``x @ weight_rows.T``.

    Values are sorted best first; indices are those ``torch.topk`` gives on the same scores (its
    heap path, ``k * 64 <= N``; for larger k the scores go through ``torch.topk`` itself).
    """
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
    mr, nr = _tile(m)
    spec = TopkGemmSpec(m, n, kd, k, bool(largest), mr, nr)
    fn = entry(spec, 4)
    packed = pack_panels(weight_rows, nr)
    w_ptr, symbol = packed.data_ptr(), spec.symbol
    x_shape, out_shape = (m, kd), (m, k)
    f32, i64, empty, threads = torch.float32, torch.int64, torch.empty, torch.get_num_threads

    def run(x: torch.Tensor):
        if not (x.shape == x_shape and x.dtype == f32 and x.is_contiguous()):
            x = checked(x, x_shape, "linear_topk input")
        vals = empty(out_shape, dtype=f32)
        idx = empty(out_shape, dtype=i64)
        if _profiler_enabled():
            with record_function(symbol):
                fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), threads())
        else:
            fn(x.data_ptr(), w_ptr, vals.data_ptr(), idx.data_ptr(), threads())
        return vals, idx

    run.spec, run.packed_weight = spec, packed
    return run
