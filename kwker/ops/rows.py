"""Tensor plumbing for the row kernels: rows view of the input, output addressing, the call.

A row kernel reads ``rows`` contiguous rows of ``n`` elements ``in_rs`` apart and writes each
output through a (row stride, element stride) pair, so outputs keep exactly the strides ATen gives
them. Inputs whose rows are not contiguous are copied first (ATen copies them too).
"""
from __future__ import annotations

import warnings

import torch

from ..codegen.sorting import NARG, SLOTS, scratch_layout
from ..runtime.calling import call

# ATen's grain for row-parallel sorting ops: 32768 elements per task
GRAIN = 32768
MAX_ROW = 2**31 - 1  # indices are i32 inside the kernels

DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64",
          torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8"}


def rows_of(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int, int]:
    """(rows x n) view of ``x`` with ``dim`` last and unit element stride (copying if needed)."""
    xm = x.movedim(dim, -1) if x.dim() else x.reshape(1)
    n = xm.shape[-1]
    rows = xm.numel() // n if n else 0
    x2 = xm.reshape(rows, n)
    if n > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, rows, n


class OutRows:
    """Kernel addressing of an output tensor whose ``dim`` holds each row's results."""

    def __init__(self, out: torch.Tensor, dim: int, rows: int, m: int):
        om = out.movedim(dim, -1) if out.dim() else out.reshape(1)
        self.final, self.tmp = om, None
        try:
            view = om.view(rows, m)
            self.ptr, self.rs, self.es = view.data_ptr(), view.stride(0), view.stride(1)
        except RuntimeError:  # not expressible as rows x m: write densely, copy once
            self.tmp = torch.empty((rows, m), dtype=out.dtype)
            self.ptr, self.rs, self.es = self.tmp.data_ptr(), m, 1

    def done(self) -> None:
        if self.tmp is not None:
            self.final.copy_(self.tmp.view(self.final.shape))


class DenseOut:
    """A contiguous output the kernel indexes itself (``row * rs``), e.g. quantile's (q, row)."""

    def __init__(self, out: torch.Tensor, rs: int = 1):
        self.ptr, self.rs, self.es = out.data_ptr(), rs, 1

    def done(self) -> None:
        pass


def threads_for(rows: int, n: int) -> int:
    if rows < 2 or rows * n < GRAIN:
        return 1
    return max(1, min(torch.get_num_threads(), rows))


def run(spec, x2: torch.Tensor, rows: int, n: int, out_v, out_i, params=(0, 0, 0, 0),
        nthreads: int | None = None) -> None:
    """Call ``spec``'s row kernel over ``rows`` rows of ``x2``."""
    nthreads = threads_for(rows, n) if nthreads is None else nthreads
    layout = scratch_layout(spec.op, spec.dtype, n, spec.stable)
    scratch = torch.empty(nthreads * layout["size"], dtype=torch.uint8)
    args = [0] * NARG
    args[0:4] = [nthreads, rows, scratch.data_ptr(), layout["size"]]
    args[SLOTS["src"]] = x2.data_ptr()
    args[SLOTS["in_rs"]] = x2.stride(0) if rows > 1 else n
    args[SLOTS["n"]] = n
    for name, o in (("out_v", out_v), ("out_i", out_i)):
        if o is not None:
            args[SLOTS[name]], args[SLOTS[name + "_rs"]], args[SLOTS[name + "_es"]] = (
                o.ptr, o.rs, o.es)
    for i, p in enumerate(params):
        args[SLOTS[f"p{i}"]] = p
    call(spec, args)
    for o in (out_v, out_i):
        if o is not None:
            o.done()


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
