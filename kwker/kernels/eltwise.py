"""Factories for elementwise kernels (GELU in both forms), float32 or bfloat16."""
from __future__ import annotations

import torch

from ._call import _profiler_enabled, checked, entry, record_function
from .specs import EltwiseSpec

_GELU_OPS = {"none": "gelu", "tanh": "gelu_tanh"}
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _checked(x: torch.Tensor, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``x`` flat, contiguous and of ``dtype``, or a useful error (slow path only)."""
    if dtype == torch.float32:
        return checked(x.reshape(-1), (numel,), name)
    if x.dtype != dtype:
        raise NotImplementedError(f"{name}: {dtype} kernel, got {x.dtype}")
    if x.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: CPU tensors only, got {x.device}")
    return x.reshape(-1).contiguous()


def make_eltwise(op: str, numel: int, dtype: torch.dtype = torch.float32):
    """``callable(x) -> op(x)`` for contiguous ``x`` of ``dtype`` (float32 or bfloat16) with
    ``numel`` elements. bf16 is computed in float32 and rounded once, as ATen does."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"kwker {op}: float32 or bfloat16 only, got {dtype}")
    spec = EltwiseSpec(op, int(numel), _DTYPES[dtype])
    fn = entry(spec, 2)
    symbol = spec.symbol
    get_threads = torch.get_num_threads

    def run(x: torch.Tensor) -> torch.Tensor:
        if not (x.numel() == numel and x.dtype == dtype and x.is_contiguous()):
            x = _checked(x, numel, dtype, f"kwker {op}").view(x.shape)
        out = torch.empty_like(x)
        if _profiler_enabled():
            with record_function(symbol):
                fn(x.data_ptr(), out.data_ptr(), get_threads())
        else:
            fn(x.data_ptr(), out.data_ptr(), get_threads())
        return out

    run.spec = spec
    return run


def make_gelu(numel: int, approximate: str = "none", dtype: torch.dtype = torch.float32):
    """GELU over ``numel`` contiguous float32 or bfloat16: exact erf form or
    ``approximate="tanh"``."""
    if approximate not in _GELU_OPS:
        raise ValueError(f"GELU approximate must be 'none' or 'tanh', not {approximate!r}")
    return make_eltwise(_GELU_OPS[approximate], numel, dtype)
