"""Sorting-type nodes -> the drop-in's ATen-identical kernels (``kwker.ops.sorting``).

One *variant* per distinct signature (``median`` over all elements and along a dim differ in
arguments and results, so do ``quantile`` with a float or a tensor ``q``). ``run`` takes Kwker's
kernel when the case is Kwker's and ATen's kernel otherwise, as the drop-in does; results are
ATen's, values, indices, ties and strides included, so no tolerance applies to them.
"""
from __future__ import annotations

import importlib

import torch
from torch.fx import Node

OPS = ("topk", "sort", "kthvalue", "mode", "median", "nanmedian", "quantile", "nanquantile",
       "argsort", "msort")
_aten = torch.ops.aten
RETURN_TYPES = {"topk": torch.return_types.topk, "sort": torch.return_types.sort,
                "kthvalue": torch.return_types.kthvalue, "mode": torch.return_types.mode,
                "median_dim": torch.return_types.median,
                "nanmedian_dim": torch.return_types.nanmedian}


def module():
    """``kwker.ops.sorting``, or None before it exists or on a torch whose ties are unverified."""
    try:
        mod = importlib.import_module("kwker.ops.sorting")
        verified = getattr(importlib.import_module("kwker.torch_ops"), "torch_verified", None)
    except ImportError:
        return None
    if verified is not None and not verified():
        return None
    importlib.import_module("kwker.ops.thresholds").apply()  # this CPU's, once measured
    return mod


def variant(op: str, b: dict) -> tuple[str, tuple] | None:
    """(variant, arguments after x) for a bound sorting node; None if it is not one we take.

    A tensor ``q`` of quantile is the only argument that may be a node (read at run time).
    """
    if op in ("topk",):
        return "topk", (b["k"], b["dim"], b["largest"], b["sorted"])
    if op == "sort":
        return "sort", (b["dim"], b["descending"], bool(b["stable"]))
    if op == "argsort":
        return "argsort", (b["dim"], b["descending"], bool(b["stable"]))
    if op == "kthvalue":
        return "kthvalue", (b["k"], b["dim"], b["keepdim"])
    if op == "mode":
        return "mode", (b["dim"], b["keepdim"])
    if op == "msort":
        return "msort", ()
    if op in ("median", "nanmedian"):
        if b["dim"] is None:
            return (op + "_all", ()) if b["keepdim"] is False else None
        return op + "_dim", (b["dim"], b["keepdim"])
    if op in ("quantile", "nanquantile"):
        q = b["q"]
        if isinstance(q, Node):
            return op, (q, b["dim"], b["keepdim"], b["interpolation"])
        if isinstance(q, (int, float)) and not isinstance(q, bool):
            return op + "_scalar", (float(q), b["dim"], b["keepdim"], b["interpolation"])
    return None


def aten(v: str, x, *a):
    """ATen's own kernel for variant ``v`` (the fallback, and the fake implementation)."""
    if v == "topk":
        return _aten.topk.default(x, *a)
    if v in ("sort", "argsort"):
        dim, descending, stable = a
        op = _aten.sort.stable if v == "sort" else _aten.argsort.stable
        return op(x, stable=stable, dim=dim, descending=descending)
    if v == "kthvalue":
        return _aten.kthvalue.default(x, *a)
    if v == "mode":
        return _aten.mode.default(x, *a)
    if v == "msort":
        return _aten.msort.default(x)
    if v.endswith("_all"):
        return (_aten.median if v == "median_all" else _aten.nanmedian).default(x)
    if v.endswith("_dim"):
        return (_aten.median if v == "median_dim" else _aten.nanmedian).dim(x, *a)
    q, dim, keepdim, interpolation = a
    op = _aten.quantile if v.startswith("quantile") else _aten.nanquantile
    overload = op.scalar if v.endswith("_scalar") else op.default
    return overload(x, q, dim, keepdim, interpolation=interpolation)


def _fast(mod, v: str, x, *a):
    if v == "topk":
        return mod.fast_topk(x, *a)
    if v in ("sort", "argsort", "msort"):
        dim, descending, stable = a if a else (0, False, False)
        r = mod.fast_sort(x, stable, dim, descending)
        if r is NotImplemented:
            return r
        return r[1] if v == "argsort" else r[0] if v == "msort" else r
    if v == "kthvalue":
        return mod.fast_kthvalue(x, *a)
    if v == "mode":
        return mod.fast_mode(x, *a)
    if v.endswith("_all"):
        return mod.fast_median_all(x, ignore_nan=v.startswith("nan"))
    if v.endswith("_dim"):
        return mod.fast_median_dim(x, *a, ignore_nan=v.startswith("nan"))
    q, dim, keepdim, interpolation = a
    return mod.fast_quantile(x, q, dim, keepdim, interpolation, ignore_nan=v.startswith("nan"))


def run(mod, v: str, x, *a):
    """Kwker's kernel where it applies, else ATen's: ATen's result either way (plain tuples)."""
    r = _fast(mod, v, x, *a)
    return aten(v, x, *a) if r is NotImplemented else r
