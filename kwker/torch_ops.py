"""Eager drop-in: PyTorch's CPU kernels for sorting-type ops, replaced by Kwker's.

    import kwker.torch_ops as kto
    with kto.accelerated():      # scoped; nestable; undone on exit and on exceptions
        model(x)
    kto.install()                # process-wide; kto.uninstall() undoes it

The replacement happens in PyTorch's dispatcher (``torch.library``, CPU dispatch key), so
``torch.topk``, ``Tensor.topk``, ``torch.ops.aten.topk.default`` and the ``out=`` forms all reach
it, autograd keeps its own backward formulas, and ops that are not replaced cost nothing extra.
Every case Kwker does not take (other devices, dtypes or layouts, arguments ATen rejects, tiny
inputs) calls the original ATen kernel, captured before the override. quantile/nanquantile are
composite ops in ATen; with autograd recording they run ATen's own composite (whose sort is then
Kwker's), so gradients are ATen's.

Tie order is a property of one torch release; on an unverified release nothing is replaced.
"""
from __future__ import annotations

import functools
import threading
import warnings
from contextlib import contextmanager

import torch

from .ops import sorting as ops
from .ops import thresholds

VERIFIED_TORCH = ("2.13.0",)

_CPU = torch._C.DispatchKey.CPU
_AUTOGRAD_CPU = torch._C.DispatchKey.AutogradCPU


def torch_verified() -> bool:
    return torch.__version__.split("+")[0] in VERIFIED_TORCH


def _original(op: str, key=_CPU):
    """The ATen kernel registered for ``op`` at ``key`` before Kwker's override, as a callable
    (a partial of the C++ kernel: no Python frame between an override and ATen)."""
    kernel = torch._C._dispatch_get_computed_kernel_for_dispatch_key(op, key)
    return functools.partial(kernel.call_boxed, torch._C.DispatchKeySet(key))


def _overrides() -> list[tuple[str, object, str]]:
    """(schema name, implementation, dispatch key) of every override."""
    orig = {name: _original("aten::" + name) for name in (
        "topk", "topk.values", "sort.stable", "sort.values_stable", "kthvalue.values",
        "median", "median.dim_values", "nanmedian", "nanmedian.dim_values", "mode",
        "quantile", "quantile.scalar", "quantile.out", "quantile.scalar_out",
        "nanquantile", "nanquantile.scalar", "nanquantile.out", "nanquantile.scalar_out")}

    def fast_or(name, result, *args, **kwargs):
        return orig[name](*args, **kwargs) if result is NotImplemented else result

    # Each override first hands inputs below the op's size cut-off (read at call time) straight
    # to ATen: the Python call into the override is already most of a tiny call's cost.
    def topk(self, k, dim=-1, largest=True, sorted=True):
        if self.numel() < ops.MIN_NUMEL["topk"]:
            return orig["topk"](self, k, dim, largest, sorted)
        return fast_or("topk", ops.fast_topk(self, k, dim, largest, sorted),
                       self, k, dim, largest, sorted)

    def topk_out(self, k, dim=-1, largest=True, sorted=True, *, values, indices):
        r = ops.fast_topk(self, k, dim, largest, sorted) if (
            self.numel() >= ops.MIN_NUMEL["topk"] and _plain_outs(self, values, indices)) else None
        if r is None or r is NotImplemented:
            return orig["topk.values"](self, k, dim, largest, sorted, values=values,
                                       indices=indices)
        return ops.write_out(r, (values, indices))

    def sort(self, *, stable, dim=-1, descending=False):
        if self.numel() < ops.MIN_NUMEL["stable" if stable else "sort"]:
            return orig["sort.stable"](self, stable=stable, dim=dim, descending=descending)
        return fast_or("sort.stable", ops.fast_sort(self, bool(stable), dim, descending),
                       self, stable=stable, dim=dim, descending=descending)

    def sort_out(self, *, stable, dim=-1, descending=False, values, indices):
        r = (ops.fast_sort(self, bool(stable), dim, descending)
             if _plain_outs(self, values, indices) else None)
        if r is None or r is NotImplemented:
            return orig["sort.values_stable"](self, stable=stable, dim=dim,
                                              descending=descending, values=values,
                                              indices=indices)
        return ops.write_out(r, (values, indices))

    def reduction_out(name, family, fast):
        def impl(self, *args, values, indices):
            # median(dim) of an expanded input is always Kwker's (ATen reads it wrongly)
            small = self.numel() < ops.MIN_NUMEL[family] and (family != "median"
                                                          or 0 not in self.stride())
            r = None
            if not small and _plain_outs(self, values, indices):
                # the functional forms' outs come fresh from ATen's wrapper: written directly
                fresh = values.numel() == 0 and indices.numel() == 0
                r = fast(self, *args, outs=(values, indices) if fresh else None)
            if r is None or r is NotImplemented:
                return orig[name](self, *args, values=values, indices=indices)
            return ops.write_out(r, (values, indices))
        return impl

    def median_all(self):
        if self.numel() < ops.MIN_NUMEL["median_all"]:
            return orig["median"](self)
        return fast_or("median", ops.fast_median_all(self), self)

    def nanmedian_all(self):
        if self.numel() < ops.MIN_NUMEL["median_all"]:
            return orig["nanmedian"](self)
        return fast_or("nanmedian", ops.fast_median_all(self, True), self)

    def mode(self, dim=-1, keepdim=False):
        if self.numel() < ops.MIN_NUMEL["mode"]:
            return orig["mode"](self, dim, keepdim)
        return fast_or("mode", ops.fast_mode(self, dim, keepdim), self, dim, keepdim)

    impls = [
        ("topk", topk, "CPU"), ("topk.values", topk_out, "CPU"),
        ("sort.stable", sort, "CPU"), ("sort.values_stable", sort_out, "CPU"),
        ("kthvalue.values", reduction_out(
            "kthvalue.values", "kthvalue", lambda x, k, dim=-1, keepdim=False, outs=None:
            ops.fast_kthvalue(x, k, dim, keepdim, outs)), "CPU"),
        ("median", median_all, "CPU"), ("nanmedian", nanmedian_all, "CPU"),
        ("median.dim_values", reduction_out(
            "median.dim_values", "median", lambda x, dim, keepdim=False, outs=None:
            ops.fast_median_dim(x, dim, keepdim, outs=outs)), "CPU"),
        ("nanmedian.dim_values", reduction_out(
            "nanmedian.dim_values", "median", lambda x, dim, keepdim=False, outs=None:
            ops.fast_median_dim(x, dim, keepdim, ignore_nan=True, outs=outs)), "CPU"),
        ("mode", mode, "CPU"),
    ]
    for base, ignore_nan in (("quantile", False), ("nanquantile", True)):
        impls += _quantile_overrides(base, ignore_nan, orig)
    return impls


def _plain_outs(x, values, indices) -> bool:
    """out= tensors Kwker writes through a copy; anything unusual is left to ATen."""
    return (values.dtype == x.dtype and indices.dtype == torch.int64
            and values.device.type == "cpu" and indices.device.type == "cpu")


def _quantile_overrides(base: str, ignore_nan: bool, orig: dict):
    names = (base, base + ".scalar", base + ".out", base + ".scalar_out")
    autograd = {n: _original("aten::" + n, _AUTOGRAD_CPU) for n in names}

    def fast(self, q, dim, keepdim, interpolation):
        return ops.fast_quantile(self, q, dim, keepdim, interpolation, ignore_nan)

    def make(name, with_out):
        if with_out:
            def impl(self, q, dim=None, keepdim=False, *, interpolation="linear", out):
                r = fast(self, q, dim, keepdim, interpolation) if out.dtype == self.dtype \
                    else NotImplemented
                if r is NotImplemented:
                    return orig[name](self, q, dim, keepdim, interpolation=interpolation,
                                      out=out)
                return ops.write_out((r,), (out,))[0]
        else:
            def impl(self, q, dim=None, keepdim=False, *, interpolation="linear"):
                r = fast(self, q, dim, keepdim, interpolation)
                if r is NotImplemented:
                    return orig[name](self, q, dim, keepdim, interpolation=interpolation)
                return r

        def autograd_impl(self, q, dim=None, keepdim=False, **kwargs):
            needs_grad = torch.is_grad_enabled() and (
                self.requires_grad or (isinstance(q, torch.Tensor) and q.requires_grad))
            if needs_grad:  # ATen's composite: differentiable, and its sort is Kwker's
                return autograd[name](self, q, dim, keepdim, **kwargs)
            with torch._C._AutoDispatchBelowAutograd():
                return impl(self, q, dim, keepdim, **kwargs)
        return [(name, impl, "CPU"), (name, autograd_impl, "AutogradCPU")]

    out = []
    for name in names:
        out += make(name, name.endswith("out"))
    return out


class _State:
    lock = threading.Lock()
    users = 0          # active accelerated() blocks, plus one while install() is in force
    installed = False  # install() called (and not undone)
    library = None
    warned = False


def _activate() -> None:
    if not torch_verified():
        if not _State.warned:
            _State.warned = True
            warnings.warn(
                f"kwker: exact parity is verified for torch {', '.join(VERIFIED_TORCH)}, "
                f"not {torch.__version__}; every sorting op keeps running on ATen.",
                RuntimeWarning, stacklevel=3)
        return
    thresholds.apply()  # this CPU's measured size thresholds, where kwker-cache prewarm took them
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
        for name, impl, key in _overrides():
            lib.impl(name, impl, key)
    _State.library = lib


def _deactivate() -> None:
    if _State.library is not None:
        _State.library._destroy()
        _State.library = None


def _acquire() -> None:
    with _State.lock:
        _State.users += 1
        if _State.users == 1:
            _activate()


def _release() -> None:
    with _State.lock:
        _State.users -= 1
        if _State.users == 0:
            _deactivate()


def install() -> None:
    """Replace the kernels for the whole process (idempotent)."""
    if not _State.installed:
        _State.installed = True
        _acquire()


def uninstall() -> None:
    """Undo ``install()`` (idempotent); open ``accelerated()`` blocks keep theirs until exit."""
    if _State.installed:
        _State.installed = False
        _release()


def is_active() -> bool:
    return _State.library is not None


@contextmanager
def accelerated():
    """Kwker's kernels inside the block; nestable, undone on exit and on exceptions.

    The dispatcher is process-wide, so other threads see the replacement while a block is open.
    """
    _acquire()
    try:
        yield
    finally:
        _release()
