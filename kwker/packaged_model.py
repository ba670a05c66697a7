"""A loaded package's programs as callables: their inputs checked, flattened and copied as the
flat program needs them, before any kernel runs (``packaging.load_package`` makes them)."""
from __future__ import annotations

from pathlib import Path

import torch

from .lowering.exported import build_tree, dtype_name, dtype_of, flatten_tree, tree_is_flat_tuple
from .lowering.report import Report

__all__ = ["PackagedModel", "inputs_text"]


class PackagedModel:
    """A loaded package: ``model(*inputs)`` runs its flat program under autograd off.

    The inputs are structured as the exported program took them (tensors, or tuples, lists and
    dicts of them: a decoder's KV cache as a tuple of (key, value) pairs). They are checked
    before any kernel runs: their number, type, dtype, device, rank and sizes (fixed ones
    exactly, dynamic ones in the exported range and equal wherever the export tied them).
    ``report`` says which nodes run as Kwker kernels.
    """

    def __init__(self, path: Path, name: str | None, graph: dict, versions: dict, program,
                 report: Report, any_strides: set = frozenset()):
        self.path, self.name, self.report, self._program = path, name, report, program
        self.inputs = graph["inputs"]
        self.versions = versions
        self._check = _checker(self.inputs, any_strides)
        tree = graph.get("in_tree")   # None or a flat tuple: the inputs are taken as they come
        self._flatten = None if tree is None or tree_is_flat_tuple(tree) else \
            lambda args: flatten_tree(tree, args, [], "the inputs")
        tree = graph["out_tree"]
        if tree_is_flat_tuple(tree):
            self._wrap = tuple
        elif isinstance(tree, dict) and "return_type" in tree and \
                all(c == "leaf" for c in tree["items"]):
            self._wrap = getattr(torch.return_types, tree["return_type"])
        elif tree == "leaf":
            self._wrap = _first
        else:
            self._wrap = lambda flat: build_tree(tree, iter(flat))

    def __call__(self, *args):
        if self._flatten is not None:   # the exported program's nested inputs, as it took them
            args = self._flatten(args)
        args = self._check(args)
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            out = self._program(args)
        finally:
            torch._C._set_grad_enabled(prev)
        return self._wrap(out)

    def __repr__(self) -> str:
        which = "" if self.name is None else f", program {self.name!r}"
        return (f"PackagedModel({str(self.path)!r}{which}, inputs: "
                f"{inputs_text(self.inputs)}; {len(self.report.kernels)} Kwker kernels)")


def _first(flat):
    return flat[0]


def _checker(inputs: list, any_strides: set = frozenset()):
    """A function validating a call's inputs (contiguous copies of strided ones, but for those
    named in ``any_strides``: a KV cache's past); the common case costs a few attribute reads per
    input, the messages are built only on failure."""
    names = ", ".join(i["name"] for i in inputs)
    plan = []
    for pos, i in enumerate(inputs):
        fixed = tuple((d, s) for d, s in enumerate(i["shape"]) if isinstance(s, int))
        syms = tuple((d, s["sym"], s["min"], s["max"]) for d, s in enumerate(i["shape"])
                     if isinstance(s, dict) and "sym" in s)
        plan.append((pos, i, dtype_of(i["dtype"]), i["device"] == "cpu",
                     len(i["shape"]), fixed, syms, i["name"] in any_strides))
    n = len(plan)
    tensor = torch.Tensor

    def check(args):
        if len(args) != n:
            raise TypeError(f"the packaged model takes {n} input(s) ({names}), "
                            f"got {len(args)}")
        out = list(args)
        seen = {}
        for pos, spec, dtype, cpu, rank, fixed, syms, strided in plan:
            a = args[pos]
            if not isinstance(a, tensor):
                raise TypeError(f"input {spec['name']!r} must be a Tensor, not "
                                f"{type(a).__name__}")
            if a.dtype is not dtype or a.is_cpu is not cpu or a.dim() != rank:
                _refuse(spec, dtype, a)
            size = a.shape
            for d, want in fixed:
                if size[d] != want:
                    _refuse(spec, dtype, a)
            for d, sym, lo, hi in syms:
                v = size[d]
                if v < lo or (hi is not None and v > hi):
                    raise RuntimeError(
                        f"input {spec['name']!r}: dim {d} ({sym}) must be in {lo}..{hi}, the "
                        f"range it was exported with, got {v}")
                first = seen.setdefault(sym, (v, spec["name"]))
                if first[0] != v:
                    raise RuntimeError(
                        f"input {spec['name']!r}: dim {d} ({sym}) is {v}, but input "
                        f"{first[1]!r} has {first[0]} in the same dim of the export")
            if not (strided or a.is_contiguous()):
                out[pos] = a.contiguous()
        return out
    return check


def _refuse(spec: dict, dtype: torch.dtype, a: torch.Tensor):
    shape = spec["shape"]
    want = f"a {spec['device']} {spec['dtype']} tensor of shape {_shape_text(shape)}"
    got = f"a {a.device.type} {dtype_name(a.dtype)} tensor of shape " \
          f"{list(a.shape)}"
    if a.dim() == len(shape) and a.dtype == dtype and \
            a.device.type == spec["device"]:
        d = next(d for d, s in enumerate(shape) if isinstance(s, int) and a.shape[d] != s)
        raise RuntimeError(f"input {spec['name']!r} must have size {shape[d]} in dim {d}: "
                           f"expected {want}, got {got}")
    raise RuntimeError(f"input {spec['name']!r}: expected {want} (rank {len(shape)}), got {got}")


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) if isinstance(s, int) else s.get("sym", s.get("expr", "?"))
                           for s in shape) + "]"


def inputs_text(inputs: list) -> str:
    def dim(d):
        if isinstance(d, int):
            return str(d)
        if "sym" in d:
            hi = d["max"] if d["max"] is not None else "inf"
            return f"{d['sym']}[{d['min']}..{hi}]"
        return d["expr"]
    return ", ".join(f"{i['name']}: {i['dtype']}[{', '.join(dim(d) for d in i['shape'])}]"
                     for i in inputs)
