"""What every factory's callable shares: the ctypes entry point, input checks, profiler names.

Per call a factory's callable does only this: check its inputs cheaply, ``torch.empty`` the
output, make one ctypes call (which releases the GIL). When the torch profiler is on, the call is
wrapped in ``record_function(spec.symbol)`` so traces show kernel names; the check for that is a
single C call.
"""
from __future__ import annotations

import ctypes

import torch

from ..runtime.kernel import get_kernel

_profiler_enabled = torch.autograd._profiler_enabled
record_function = torch.profiler.record_function
F32 = torch.float32


def entry(spec, n_ptrs: int, n_ints: int = 1):
    """ctypes function for ``void sym(ptr * n_ptrs, i64 * n_ints)``, compiled or cached."""
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * n_ptrs + [ctypes.c_int64] * n_ints))
    return proto(get_kernel(spec))


def contiguous_strides(shape) -> tuple:
    """The strides torch gives a contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def require_f32(*tensors, what: str = "kwker kernel") -> None:
    for t in tensors:
        if t is not None and t.dtype != F32:
            raise NotImplementedError(f"{what} is float32 only, got {t.dtype}")


def checked(x: torch.Tensor, shape: tuple, name: str) -> torch.Tensor:
    """``x`` as a contiguous float32 tensor of ``shape`` or a useful error (slow path only)."""
    if x.dtype != F32:
        raise NotImplementedError(f"{name}: float32 only, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: CPU tensors only, got {x.device}")
    return x.contiguous()
