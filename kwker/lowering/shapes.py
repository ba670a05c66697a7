"""Concrete shapes, strides and dtypes of every node, for one set of concrete inputs.

Kernels are specialised to the sizes they see, so each specialisation runs the graph once on fake
tensors (``FakeTensorMode``: metadata only, no arithmetic and no side effects on the real inputs)
and records what every node produces. Nodes the decomposition pass added have no dynamo metadata,
which is why the propagation is redone rather than read from ``node.meta``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Interpreter, Node
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..kernels._call import contiguous_strides


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @property
    def contiguous(self) -> bool:
        return self.stride == contiguous_strides(self.shape) or same_layout(
            self.shape, self.stride, contiguous_strides(self.shape))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def same_layout(shape, a, b) -> bool:
    """Strides that address the same elements the same way (size-1 dims do not matter)."""
    return all(sa == sb or n <= 1 for n, sa, sb in zip(shape, a, b))


def known_size(s):
    """An int where the size is known, else the symbolic size itself (``int()`` on a symbolic
    size would make dynamo guard on its value: a recompile for every new size)."""
    if isinstance(s, torch.SymInt):
        known = s.node.maybe_as_int()
        return s if known is None else known
    return int(s)


def _describe(v):
    """Plain metadata of a fake value (sizes stay symbolic where they are)."""
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(known_size(s) for s in v.shape),
                          tuple(known_size(s) for s in v.stride()),
                          v.dtype, v.device.type, bool(v.requires_grad))
    if isinstance(v, (tuple, list)):
        return tuple(_describe(x) for x in v)
    if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device,
                      torch.SymInt)):
        return v
    return None


class _Recorder(Interpreter):
    def __init__(self, gm: GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.metas: dict[Node, object] = {}

    def run_node(self, n: Node):
        result = super().run_node(n)
        self.metas[n] = _describe(result)
        return result


def propagate(gm: GraphModule, args: list) -> dict[Node, object]:
    """Metadata (TensorMeta, tuples of them, or plain values) of every node for ``args``.

    ``args`` are real values (tensors, ints); they are converted to static fake tensors, so the
    result is concrete even when the graph was traced with symbolic sizes.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fake = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
            for a in args]
    rec = _Recorder(gm)
    with mode:
        rec.run(*fake)
    return rec.metas


def propagate_symbolic(gm: GraphModule) -> dict[Node, object]:
    """Metadata from dynamo's own fake inputs: sizes stay symbolic where dynamo made them so."""
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    modes = [f.fake_mode for f in fakes if isinstance(f, torch.Tensor) and hasattr(f, "fake_mode")]
    if not modes:
        raise RuntimeError("the graph carries no fake tensors")
    mode = modes[0]
    rec = _Recorder(gm)
    with mode:
        rec.run(*fakes)
    return rec.metas


def is_concrete(meta) -> bool:
    return isinstance(meta, TensorMeta) and all(isinstance(s, int) for s in meta.shape)
