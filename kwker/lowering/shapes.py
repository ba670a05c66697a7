"""Concrete shapes, strides and dtypes of every node, for one set of concrete inputs.

Kernels are specialised to the sizes they see, so each specialisation runs the graph once on fake
tensors (``FakeTensorMode``: metadata only, no arithmetic and no side effects on the real inputs)
and records what every node produces. Nodes the decomposition pass added have no dynamo metadata,
which is why the propagation is redone rather than read from ``node.meta``.

A graph loaded from a package (``kwker.package``) carries its metadata instead, with ``Sym`` for
the sizes its export declared dynamic: no fake tensors (and no sympy) on the load path, which is
why those imports are deferred to the functions that propagate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

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


class Sym:
    """A size read at call time in a packaged graph: ``coeff`` times the product of the named
    symbols (what strides of contiguous tensors are), or an opaque expression ``text``.

    It supports what the lowering asks of a size (products, equality, and the comparisons a
    size >= 1 decides) and refuses ``int()``, so no code can specialise on it by accident.
    """

    __slots__ = ("coeff", "names", "text")

    def __init__(self, coeff: int = 1, names: tuple = (), text: str | None = None):
        self.coeff, self.names, self.text = coeff, tuple(sorted(names)), text

    @classmethod
    def named(cls, name: str) -> "Sym":
        return cls(1, (name,))

    def _key(self):
        return (self.coeff, self.names, self.text)

    def __mul__(self, other):
        if isinstance(other, int) and not isinstance(other, bool):
            other = Sym(other)
        if not isinstance(other, Sym):
            return NotImplemented
        if self.text is not None or other.text is not None:
            return Sym(text=f"({self})*({other})")
        return Sym(self.coeff * other.coeff, self.names + other.names)

    __rmul__ = __mul__

    def __add__(self, other):
        return Sym(text=f"{self}+{other}")

    __radd__ = __add__

    def __eq__(self, other):
        return isinstance(other, Sym) and self._key() == other._key()

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        return hash(self._key())

    def _at_least(self, other) -> bool:
        """Whether ``self >= other`` for every value (symbols are sizes >= 1, so a monomial is
        at least its coefficient); a TypeError where it depends on the call."""
        if self.text is None and type(other) is int and other <= self.coeff:
            return True
        raise TypeError(f"the symbolic size {self} has no known order against {other!r}")

    def __ge__(self, other):
        return self._at_least(other)

    def __gt__(self, other):
        return self._at_least(other + 1) if type(other) is int else self._at_least(other)

    def __lt__(self, other):
        return not self._at_least(other)

    def __le__(self, other):
        return not self._at_least(other + 1) if type(other) is int else self._at_least(other)

    def __index__(self):
        raise TypeError(f"the size {self} is symbolic: it is known only at call time")

    __int__ = __index__

    def __repr__(self):
        if self.text is not None:
            return self.text
        parts = ([str(self.coeff)] if self.coeff != 1 or not self.names else []) + \
            list(self.names)
        return "*".join(parts)

    def to_json(self):
        return {"expr": self.text} if self.text is not None else \
            {"sym": [self.coeff, list(self.names)]}

    @classmethod
    def from_json(cls, d: dict) -> "Sym":
        if "expr" in d:
            return cls(text=str(d["expr"]))
        coeff, names = d["sym"]
        return cls(int(coeff), tuple(map(str, names)))


def known_size(s):
    """An int where the size is known, else the symbolic size itself (``int()`` on a symbolic
    size would make dynamo guard on its value: a recompile for every new size)."""
    if isinstance(s, Sym):
        return s
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


def _recorder(gm: GraphModule, mode=None):
    """An interpreter recording each node's metadata; ``mode``: a fake mode the graph's tensor
    attributes (constants folded into it) are converted to, as its inputs are."""
    from torch.fx import Interpreter

    class Recorder(Interpreter):
        def __init__(self):
            super().__init__(gm, garbage_collect_values=True)
            self.metas: dict[Node, object] = {}

        def get_attr(self, target, args, kwargs):
            value = super().get_attr(target, args, kwargs)
            if mode is not None and isinstance(value, torch.Tensor) and \
                    not isinstance(value, torch._subclasses.FakeTensor):
                value = mode.from_tensor(value, static_shapes=True)
            return value

        def run_node(self, n: Node):
            result = super().run_node(n)
            self.metas[n] = _describe(result)
            return result
    return Recorder()


def propagate(gm: GraphModule, args: list) -> dict[Node, object]:
    """Metadata (TensorMeta, tuples of them, or plain values) of every node for ``args``.

    ``args`` are real values (tensors, ints); they are converted to static fake tensors, so the
    result is concrete even when the graph was traced with symbolic sizes.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    fake = [mode.from_tensor(a, static_shapes=True) if isinstance(a, torch.Tensor) else a
            for a in args]
    rec = _recorder(gm)
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
    rec = _recorder(gm, mode)
    with mode:
        rec.run(*fakes)
    return rec.metas


def is_concrete(meta) -> bool:
    return isinstance(meta, TensorMeta) and all(isinstance(s, int) for s in meta.shape)
