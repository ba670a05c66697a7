"""Tensor plumbing for the row kernels: rows view of the input, output addressing, the call.

A row kernel reads ``rows`` contiguous rows of ``n`` elements ``in_rs`` apart and writes each
output through a (row stride, element stride) pair, so outputs keep exactly the strides ATen gives
them. Inputs whose rows are not contiguous are copied first (ATen copies them too).
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections import Counter

import torch

from ..codegen.sorting import NARG, SLOTS, scratch_layout  # noqa: F401 (NARG: arg order)
from ..runtime.calling import call, row_stride

# ATen's grain for row-parallel sorting ops: 32768 elements per task
GRAIN = 32768
MAX_ROW = 2**31 - 1  # indices are i32 inside the kernels
calls: Counter = Counter()  # kernel calls per op: lets tests prove a fast path really ran

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64",
          torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
          torch.float16: "float16", torch.bfloat16: "bfloat16"}


def rows_of(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, row stride, rows, n): rows of ``x`` along ``dim`` with unit element stride.

    Inputs whose rows are not evenly spaced, unit-stride slices are copied (ATen copies too).
    """
    shape = x.shape
    n = shape[dim] if shape else 1
    rows = x.numel() // n if n else 0
    if dim == len(shape) - 1 and x.is_contiguous():
        return x, n, rows, n
    strides = x.stride()
    if n <= 1 or strides[dim] == 1:
        rs = row_stride(shape, strides, dim)
        if rs is not None:
            return x, rs, rows, n
    x2 = x.movedim(dim, -1).contiguous()
    return x2, n, rows, n


class OutRows:
    """Kernel addressing of an output tensor whose ``dim`` holds each row's results."""

    def __init__(self, out: torch.Tensor, dim: int, rows: int, m: int):
        self.tmp = None
        self.ptr = out.data_ptr()
        if dim == out.dim() - 1 and out.is_contiguous():
            self.rs, self.es = m, 1
            return
        shape, strides = out.shape, out.stride()
        rs = row_stride(shape, strides, dim) if shape else 0
        if rs is not None:
            self.rs, self.es = rs, (strides[dim] if shape else 1)
        else:  # not expressible as rows x m: write densely, copy once
            self.final = out.movedim(dim, -1)
            self.tmp = torch.empty((rows, m), dtype=out.dtype)
            self.ptr, self.rs, self.es = self.tmp.data_ptr(), m, 1

    def done(self) -> None:
        if self.tmp is not None:
            self.final.copy_(self.tmp.view(self.final.shape))


class DenseOut:
    """A contiguous output the kernel indexes itself (``row * rs``), e.g. quantile's (q, row)."""

    tmp = None

    def __init__(self, out: torch.Tensor, rs: int = 1):
        self.ptr, self.rs, self.es = out.data_ptr(), rs, 1

    def done(self) -> None:
        pass


def threads_for(rows: int, n: int) -> int:
    if rows < 2 or rows * n < GRAIN:
        return 1
    return max(1, min(torch.get_num_threads(), rows))


_layout_size = functools.lru_cache(maxsize=1024)(
    lambda op, dtype, n, stable: scratch_layout(op, dtype, n, stable)["size"])
_local = threading.local()


def _scratch(nbytes: int) -> int:
    """Address of this thread's scratch buffer of at least ``nbytes``: reused across calls.

    A kernel call is synchronous and never re-enters Python, so one buffer per calling thread
    is safe; it spares an allocation (and, for large rows, fresh zeroed pages) per call.
    """
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.buf = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8)
    return buf.data_ptr()


def run(spec, x2: torch.Tensor, in_rs: int, rows: int, n: int, out_v, out_i,
        params=(0, 0, 0, 0), nthreads: int | None = None) -> None:
    """Call ``spec``'s row kernel over ``rows`` rows of ``x2`` (``in_rs`` elements apart)."""
    nthreads = threads_for(rows, n) if nthreads is None else nthreads
    size = _layout_size(spec.op, spec.dtype, n, spec.stable)
    vp, vrs, ves = (out_v.ptr, out_v.rs, out_v.es) if out_v is not None else (0, 0, 0)
    ip, irs, ies = (out_i.ptr, out_i.rs, out_i.es) if out_i is not None else (0, 0, 0)
    call(spec, [nthreads, rows, _scratch(nthreads * size), size, x2.data_ptr(), in_rs, n,
                vp, vrs, ves, ip, irs, ies, *params])
    calls[spec.op] += 1
    if out_v is not None and out_v.tmp is not None:
        out_v.done()
    if out_i is not None and out_i.tmp is not None:
        out_i.done()


def resize_out(out: torch.Tensor, shape) -> None:
    """ATen's resize_output: resize a mis-shaped out tensor, warning if it held elements."""
    shape = list(shape)
    if list(out.shape) == shape:
        return
    if out.numel() != 0:
        warnings.warn(
            f"An output with one or more elements was resized since it had shape "
            f"{list(out.shape)}, which does not match the required output shape {shape}. "
            "This behavior is deprecated, and in a future PyTorch release outputs will not be "
            "resized unless they have zero elements. You can explicitly reuse an out tensor t "
            "by resizing it, inplace, to zero elements with t.resize_(0).", UserWarning)
    out.resize_(shape)
