"""Factories for elementwise kernels (GELU in both forms)."""
from __future__ import annotations

import torch

from ._call import _profiler_enabled, checked, entry, record_function
from .specs import EltwiseSpec

_GELU_OPS = {"none": "gelu", "tanh": "gelu_tanh"}


def make_eltwise(op: str, numel: int):
    """``callable(x) -> op(x)`` for contiguous float32 ``x`` with ``numel`` elements."""
    spec = EltwiseSpec(op, int(numel))
    fn = entry(spec, 2)
    symbol = spec.symbol
    get_threads = torch.get_num_threads

    def run(x: torch.Tensor) -> torch.Tensor:
        if not (x.numel() == numel and x.dtype == torch.float32 and x.is_contiguous()):
            x = checked(x.reshape(-1), (numel,), f"kwker {op}").view(x.shape)
        out = torch.empty_like(x)
        if _profiler_enabled():
            with record_function(symbol):
                fn(x.data_ptr(), out.data_ptr(), get_threads())
        else:
            fn(x.data_ptr(), out.data_ptr(), get_threads())
        return out

    run.spec = spec
    return run


def make_gelu(numel: int, approximate: str = "none"):
    """GELU over ``numel`` contiguous float32: exact erf form or ``approximate="tanh"``."""
    if approximate not in _GELU_OPS:
        raise ValueError(f"GELU approximate must be 'none' or 'tanh', not {approximate!r}")
    return make_eltwise(_GELU_OPS[approximate], numel)
