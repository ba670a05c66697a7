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


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def same_layout(shape, a, b) -> bool:
    """Strides that address the same elements the same way (size-1 dims do not matter)."""
    return all(sa == sb or n <= 1 for n, sa, sb in zip(shape, a, b))


def _describe(v):
    """Plain metadata of a fake value; None for what is not concrete (data-dependent sizes)."""
    if isinstance(v, torch.Tensor):
        try:
            return TensorMeta(tuple(int(s) for s in v.shape), tuple(int(s) for s in v.stride()),
                              v.dtype, v.device.type, bool(v.requires_grad))
        except (TypeError, RuntimeError):
            return None
    if isinstance(v, (tuple, list)):
        return tuple(_describe(x) for x in v)
    if isinstance(v, (int, float, bool, str, type(None), torch.dtype, torch.device)):
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
