"""What every factory's callable shares: the ctypes entry point, input checks, profiler names.

Per call a factory's callable does only this: check its inputs cheaply, ``torch.empty`` the
output, make one ctypes call (which releases the GIL). When the torch profiler is on, the call is
wrapped in ``record_function(spec.symbol)`` so traces show kernel names; the check for that is a
single C call.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..runtime.kernel import get_kernel

_profiler_enabled = torch.autograd._profiler_enabled
record_function = torch.profiler.record_function
F32 = torch.float32
_get_precision = torch._C._get_fp32_precision_getter
_PRECISION_SCOPES = (("mkldnn", "matmul"), ("mkldnn", "all"), ("generic", "all"))
# torch dtype -> the spec's dtype name, for the kernels that have a bf16 form
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def entry(spec, n_ptrs: int, n_ints: int = 1):
    """ctypes function for ``void sym(ptr * n_ptrs, i64 * n_ints)``, compiled or cached."""
    proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * n_ptrs + [ctypes.c_int64] * n_ints))
    return proto(get_kernel(spec))


ANY_ROWS = 1 << 62   # Native.max_rows of a kernel with no row limit


@dataclass(frozen=True)
class Native:
    """A factory callable's common call as ABI words, so a chain (kernels/chain.py) can make it
    from native code with no Python between kernels. ``words`` gives each argument of the
    kernel's entry point: ``("in", i)`` the data pointer of the callable's tensor argument i,
    ``("out",)`` the output's, ``("word", v)`` a constant (a weight's address; None for null),
    ``("rows",)`` the row count, ``("numel",)`` the output's elements, ``("width",)`` the first
    argument's last dim, ``("threads",)`` the thread count.

    The common call is the one the callable itself makes without leaving its frame: tensor
    argument i contiguous, of ``dtypes[i]``, shaped ``(*lead, widths[i])``, the output
    ``(*lead, n)`` of ``out_dtype``; ``lead`` is fixed, or None for any leading dims whose product
    (the rows) is ``rows`` (0: any from 1 to ``max_rows``). A width of 0 is any: in a chain, that
    of the member whose output the argument is; an ``n`` of 0 is its first argument's width."""
    addr: int
    words: tuple
    widths: tuple
    dtypes: tuple
    n: int
    out_dtype: torch.dtype
    lead: tuple | None = None
    rows: int = 0
    max_rows: int = 0

    def accepts(self, lead: tuple, rows: int) -> bool:
        if self.lead is not None:
            return lead == self.lead
        return rows == self.rows if self.rows else 0 < rows <= self.max_rows


def float32_precision() -> str:
    """How precisely the user wants float32 matmuls done, as oneDNN reads it: "ieee" (the
    default), "tf32" (``torch.set_float32_matmul_precision("high")``) or "bf16" (``"medium"``);
    or the ``fp32_precision`` of ``torch.backends.mkldnn.matmul``, ``torch.backends.mkldnn``
    or ``torch.backends``, the most specific one set. Cheap enough to read per call (0.1-0.3
    us: torch's own getter, not the properties' 0.8 us each): a kernel built under one setting
    follows a later change."""
    for backend, op in _PRECISION_SCOPES:
        precision = _get_precision(backend, op)
        if precision != "none":
            return precision
    return "ieee"


def follow_precision(allowed: tuple, lower: Callable[[], Callable],
                     exact: Callable[[], Callable]) -> Callable:
    """``call(*args)``: ``lower()``'s callable while ``float32_precision()`` is in ``allowed``,
    else ``exact()``'s, each built on its first call: a kernel built to use less precision never
    runs below what the user allows at the time of the call."""
    built = {}

    def call(*args):
        fast = float32_precision() in allowed
        fn = built.get(fast)
        if fn is None:
            fn = built[fast] = (lower if fast else exact)()
        return fn(*args)
    return call


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


def kernel_dtype(dtype: torch.dtype | None, what: str) -> str:
    """The spec dtype name ("f32", "bf16") of a torch dtype, or NotImplementedError."""
    name = KERNEL_DTYPES.get(dtype or F32)
    if name is None:
        raise NotImplementedError(f"{what} runs in float32 or bfloat16, not {dtype}")
    return name


def on_rows(call, x: torch.Tensor, res, n: int, residual: bool):
    """``call(x[, res])`` on x of any leading dims as (rows, K) and a residual of the same ones
    as (rows, N); the result viewed back as (..., N). The slow path of kernels generic over rows
    (``call`` checks shapes and says what is wrong)."""
    if x.dim() in (0, 2):
        return call(x, res) if residual else call(x)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    if residual and res.shape[:-1] == lead:
        res = res.reshape(-1, res.shape[-1])
    return (call(x, res) if residual else call(x)).view(*lead, n)


def checked(x: torch.Tensor, shape: tuple, name: str, dtype: torch.dtype = F32) -> torch.Tensor:
    """``x`` as a contiguous ``dtype`` tensor of ``shape`` or a useful error (slow path only)."""
    if x.dtype != dtype:
        raise NotImplementedError(f"{name}: built for {dtype}, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: CPU tensors only, got {x.device}")
    return x.contiguous()
