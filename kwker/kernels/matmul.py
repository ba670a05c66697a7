"""``make_matmul``: products of two runtime tensors (mm, bmm, matmul), optionally ``a @ b.T``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import blocking
from ._call import _profiler_enabled, checked, entry, kernel_dtype, record_function
from .specs import GemmSpec


def make_matmul(m: int | None, k: int, n: int, batch: int | None = 1,
                b_transposed: bool = False, dtype: torch.dtype = torch.float32):
    """``callable(a (batch, m, k), b (batch, k, n)) -> (batch, m, n)``.

    ``m=None`` (or ``batch=None``) builds the kernel generic over the rows and the batch, read
    off ``a`` per call: one compile for every size; K and N stay fixed.

    With ``b_transposed`` the second operand is ``(batch, n, k)`` and the result is ``a @ b.T``
    (packed into panels per call). 2-D operands are accepted when ``batch == 1``. ``dtype``:
    float32 or bfloat16 (float32 sums, one rounding at the end).
    """
    if m is None or batch is None:
        return _make_generic(int(k), int(n), b_transposed, dtype)
    m, k, n, batch = int(m), int(k), int(n), int(batch)
    if min(m, k, n, batch) < 1:
        raise ValueError(f"make_matmul: empty shapes m={m}, k={k}, n={n}, batch={batch}")
    dt = kernel_dtype(dtype, "make_matmul")
    bf16 = dt == "bf16"
    kk = k + (k % 2) if bf16 else k   # bf16 kernels step over k pairs: odd K padded by one
    layout = "nk" if b_transposed else "kn"
    blk = blocking.choose(m, n, kk // 2 if bf16 else k, b_layout=layout, dtype=dt)
    spec = GemmSpec(m, n, kk, batch, layout, **blk.as_kwargs(), dtype=dt)
    fn = entry(spec, 5)
    symbol = spec.symbol
    a_shape = (batch, m, k)
    b_shape = (batch, n, k) if b_transposed else (batch, k, n)
    out_shape = (batch, m, n)
    empty, threads = torch.empty, torch.get_num_threads
    pad_a, pad_b = (0, kk - k), ((0, kk - k) if b_transposed else (0, 0, 0, kk - k))

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        two_d = a.dim() == 2
        if not (a.shape == a_shape and a.dtype == dtype and a.is_contiguous()):
            a = checked(a.unsqueeze(0) if two_d and batch == 1 else a, a_shape, "matmul a",
                        dtype)
        if not (b.shape == b_shape and b.dtype == dtype and b.is_contiguous()):
            b = checked(b.unsqueeze(0) if b.dim() == 2 and batch == 1 else b, b_shape,
                        "matmul b", dtype)
        if kk != k:
            a, b = F.pad(a, pad_a), F.pad(b, pad_b)
        out = empty(out_shape, dtype=dtype)
        if _profiler_enabled():
            with record_function(symbol):
                fn(a.data_ptr(), b.data_ptr(), None, None, out.data_ptr(), threads())
        else:
            fn(a.data_ptr(), b.data_ptr(), None, None, out.data_ptr(), threads())
        return out[0] if two_d else out

    run.spec = spec
    return run


def _make_generic(k: int, n: int, b_transposed: bool, dtype: torch.dtype):
    if min(k, n) < 1:
        raise ValueError(f"make_matmul: empty shapes k={k}, n={n}")
    dt = kernel_dtype(dtype, "make_matmul")
    kk = k + (k % 2) if dt == "bf16" else k
    layout = "nk" if b_transposed else "kn"
    blk = blocking.choose(None, n, kk // 2 if dt == "bf16" else k, b_layout=layout, dtype=dt)
    spec = GemmSpec(0, n, kk, 0, layout, **blk.as_kwargs(), dtype=dt)
    fn = entry(spec, 5, 3)
    symbol = spec.symbol
    empty, threads = torch.empty, torch.get_num_threads
    pad_a, pad_b = (0, kk - k), ((0, kk - k) if b_transposed else (0, 0, 0, kk - k))

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        two_d = a.dim() == 2
        if two_d:
            a, b = a[None], b[None]
        batch, m = a.shape[0], a.shape[1]
        b_shape = (batch, n, k) if b_transposed else (batch, k, n)
        if not (a.dim() == 3 and a.shape[2] == k and a.dtype == dtype and a.is_contiguous()):
            a = checked(a, (batch, m, k), "matmul a", dtype)
        if not (b.shape == b_shape and b.dtype == dtype and b.is_contiguous()):
            b = checked(b, b_shape, "matmul b", dtype)
        if kk != k:
            a, b = F.pad(a, pad_a), F.pad(b, pad_b)
        out = empty((batch, m, n), dtype=dtype)
        if batch and m:
            if _profiler_enabled():
                with record_function(symbol):
                    fn(a.data_ptr(), b.data_ptr(), None, None, out.data_ptr(), m, batch,
                       threads())
            else:
                fn(a.data_ptr(), b.data_ptr(), None, None, out.data_ptr(), m, batch, threads())
        return out[0] if two_d else out

    run.spec = spec
    return run
