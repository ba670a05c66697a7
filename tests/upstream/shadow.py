"""Shadow check: every sorting-op call an upstream test makes is re-run on ATen and compared.

A test's pass/fail only shows what its own asserts look at (often just order, or values); the
drop-in promises bit-identical results. With Kwker installed, this ``TorchFunctionMode`` runs each
replaced op a second time with Kwker uninstalled and compares values, indices, dtypes, shapes and
strides bit for bit, so the upstream tests double as a corpus of realistic inputs. Calls with
``out=`` are left alone (they may alias their inputs; the tests check those themselves).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

import kwker.torch_ops as kto

_NAMES = ("sort", "argsort", "msort", "topk", "kthvalue", "median", "nanmedian", "mode",
          "quantile", "nanquantile")
OPS = {getattr(torch, n): n for n in _NAMES} | {getattr(torch.Tensor, n): n for n in _NAMES}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's elements: NaN payloads and -0.0 compare exactly."""
    if t.dtype.is_floating_point:
        return t.contiguous().view(_BITS[t.element_size()])
    return t


def _flat(r) -> list:
    return list(r) if isinstance(r, tuple) else [r]


def _differs(got, want) -> str | None:
    """Why two op results differ (None when bit-identical, strides included)."""
    g, w = _flat(got), _flat(want)
    if len(g) != len(w):
        return f"{len(g)} outputs vs {len(w)}"
    for i, (a, b) in enumerate(zip(g, w)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i}: {a!r} vs {b!r}"
            continue
        for what, x, y in (("dtype", a.dtype, b.dtype), ("shape", a.shape, b.shape),
                           ("stride", a.stride(), b.stride())):
            if x != y:
                return f"output {i} {what}: kwker {x} vs aten {y}"
        if not torch.equal(_bits(a), _bits(b)):
            bad = (_bits(a) != _bits(b)).nonzero()
            return f"output {i}: {bad.shape[0]} elements differ, first at {bad[0].tolist()}"
    return None


def _describe(v):
    if isinstance(v, torch.Tensor):
        return f"Tensor{tuple(v.shape)}:{v.dtype}:stride{v.stride()}"
    if isinstance(v, (tuple, list)):
        return type(v)(_describe(x) for x in v)
    return v


class Shadow(TorchFunctionMode):
    """Compare each replaced op's Kwker result with ATen's; collect mismatches."""

    def __init__(self):
        super().__init__()
        self.test = None
        self.checked: dict[str, int] = {}
        self.mismatches: list[dict] = []
        self.samples: list[dict] = []  # inputs of the first mismatches, for reproducers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        got = func(*args, **kwargs)
        name = OPS.get(func)
        if name is None or kwargs.get("out") is not None or not kto.is_active():
            return got
        kto.uninstall()
        try:
            with torch.no_grad():
                want = func(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- Kwker returned where ATen raises: a difference
            want = e
        finally:
            kto.install()
        why = (f"ATen raised {type(want).__name__}: {want}" if isinstance(want, Exception)
               else _differs(got, want))
        self.checked[name] = self.checked.get(name, 0) + 1
        if why is not None:
            self.mismatches.append({"test": self.test, "op": name, "why": why,
                                    "args": _describe(args), "kwargs": _describe(kwargs)})
            if len(self.samples) < 20:
                keep = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
                self.samples.append({"test": self.test, "op": name, "args": keep,
                                     "kwargs": {k: v for k, v in kwargs.items()}})
        return got
