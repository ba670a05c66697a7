"""Eager sorting-type kernels: one row kernel per op, generic over sizes.

Contract: for each row (a contiguous slice of ``n`` input elements, rows ``in_rs`` elements apart)
the kernel writes exactly what ATen 2.13 writes: values and int64 indices, ties included
(``shared/aten-sorting-spec.md`` §3-§8).

The row function's shared pieces (keys, scratch, outputs) are in sort_rows.py, the ops in
sort_full.py (sort), sort_select.py (topk, kthvalue, median, mode) and sort_quantile.py, the exact
algorithms they run in sortalgo.py. This module picks the op's emitter and keeps the names the
runtime and the ops import.
Fast-math: none, except the quantile interpolation's explicit FMA, which is ATen's own arithmetic.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import new_module
from .rows import emit_row_driver
from .sort_full import SPLIT_LEVELS, emit_sort, task_slot
from .sort_quantile import INTERPOLATIONS, emit_quantile
from .sort_rows import NARG, SLOTS, RowKernel, scratch_layout
from .sort_select import emit_kthvalue, emit_median_all, emit_median_dim, emit_mode, emit_topk

__all__ = ["INTERPOLATIONS", "NARG", "SLOTS", "SPLIT_LEVELS", "emit", "scratch_layout",
           "task_slot"]


def emit(spec, target) -> ir.Module:
    module = new_module(spec.symbol)
    rk = RowKernel(module, spec, target)
    op = spec.op
    if op == "sort":
        emit_sort(rk)
    elif op == "topk":
        emit_topk(rk)
    elif op == "kthvalue":
        emit_kthvalue(rk)
    elif op in ("median", "nanmedian"):
        emit_median_dim(rk, op == "nanmedian")
    elif op in ("median_all", "nanmedian_all"):
        emit_median_all(rk, op == "nanmedian_all")
    elif op == "mode":
        emit_mode(rk)
    elif op in ("quantile", "nanquantile"):
        emit_quantile(rk, op == "nanquantile")
    else:
        raise ValueError(f"unknown sorting op {op!r}")
    emit_row_driver(module, spec.symbol, rk.finish())
    return module
