"""Runs of kernel steps made one native call (kernels/chain.py): a decoder layer's projection,
norm, MLP and the next layer's norm and q/k/v projections between two attentions.

Steps join a run in graph order while each kernel has a native form (``fn.native``) and takes
tensors of the run's leading dims only. The run's one step sits where its last kernel was, so
what reads a member's output must run after that: a reader whose own step comes later (a
kernel's node is computed at its kernel's output) is fine, as is a view of it, which is moved
after the run (views have no effects; a Llama's q projection is viewed to heads before k and v
are projected), and what takes no step at all, its value its input (the identity ``to`` a
Llama's norm starts with, GPT-2's view of its final norm), is seen through. Nothing
between the run's first and last kernel may write in place. Outputs read outside the run become
the step's extra values (``KernelStep.extra``); the rest live in the chain's scratch.
"""
from __future__ import annotations

import contextlib
import logging

from torch.fx import Node

from ..kernels.chain import Member
from ..runtime import kernel
from .make import make_kernel
from .ops import is_inplace, is_view
from .runner import KernelStep, is_identity
from .shapes import TensorMeta

log = logging.getLogger("kwker")
MIN_RUN = 2


def chain_kernels(steps: list[KernelStep], nodes: list[Node], metas: dict) -> list[KernelStep]:
    """``steps`` with each run of two or more chainable kernels replaced by one step; the
    views moved after their run are moved in ``nodes``' graph."""
    order = _Order(steps, nodes, metas)
    out, run, moved = [], [], []

    def close():
        if len(run) >= MIN_RUN:
            chained = _chained(run, order)
            if len(chained) == 1:
                order.move_after(run[-1].output, moved)
            out.extend(chained)
        else:
            out.extend(run)
        run.clear()
        moved.clear()

    for s in sorted(steps, key=lambda s: order.pos[s.output]):
        if not _chainable(s, metas):
            close()
            out.append(s)
            continue
        later = order.extends(run, s) if run else []
        if later is None:
            close()
        else:
            moved.extend(n for n in later if n not in moved)
        run.append(s)
    close()
    return out


def _chainable(s: KernelStep, metas: dict) -> bool:
    native = getattr(s.fn, "native", None)
    return native is not None and not s.extra and len(s.args) == len(native.widths) and all(
        isinstance(a, Node) and isinstance(metas.get(a), TensorMeta) for a in s.args) and \
        isinstance(metas.get(s.output), TensorMeta)


def _lead(meta: TensorMeta) -> tuple:
    return tuple(d if type(d) is int else str(d) for d in meta.shape[:-1])


class _Order:
    """Where each node's value is made in the program, and who reads it."""

    def __init__(self, steps: list[KernelStep], nodes: list[Node], metas: dict):
        self.nodes, self.metas = nodes, metas
        self.graph = nodes[0].graph if nodes else None
        self.kernel_of = {c: s for s in steps for c in (s.output, *s.covers, *s.extra)}
        self.index()

    def index(self) -> None:
        self.nodes[:] = list(self.graph.nodes) if self.graph is not None else []
        self.pos = {n: i for i, n in enumerate(self.nodes)}

    def made_at(self, n: Node) -> int:
        """The place of the step that computes ``n``: its kernel's output, or its own."""
        k = self.kernel_of.get(n)
        return self.pos[n if k is None else k.output]

    def identity(self, n: Node) -> bool:
        """Whether ``n`` takes no step, its value its input's (runner.is_identity)."""
        return n not in self.kernel_of and is_identity(n, self.metas)

    def readers(self, n: Node):
        """The nodes that read ``n``'s value, through identity nodes (which take no step)."""
        for u in n.users:
            if self.identity(u):
                yield from self.readers(u)
            else:
                yield u

    def aliases(self, n: Node):
        """The identity nodes on ``n``, through one another."""
        for u in n.users:
            if self.identity(u):
                yield u
                yield from self.aliases(u)

    def source(self, n: Node) -> Node:
        while self.identity(n):
            n = n.args[0]
        return n

    def extends(self, run: list[KernelStep], s: KernelStep) -> list[Node] | None:
        """The views to move after the run for ``s`` to join it, or None where it cannot."""
        lead = _lead(self.metas[run[0].output])
        if any(_lead(self.metas[n]) != lead for n in (*s.args, s.output)):
            return None
        made = {k.output: k.fn.native for k in run}
        native = s.fn.native
        for a, width, dtype in zip(s.args, native.widths, native.dtypes):
            got = made.get(self.source(a))
            if got is None and not width:   # rows of any width: only a member's are known
                return None
            if got is not None and (got.out_dtype != dtype or width and got.n and got.n != width):
                return None
        inside = {n for k in (*run, s) for n in (k.output, *k.covers)}
        end = self.pos[s.output]
        later: list[Node] = []
        for k in run:
            for u in self.readers(k.output):
                if u not in inside and self.made_at(u) < end and \
                        not self._movable(u, inside, end, later):
                    return None
        start = min(self.pos[n] for k in run for n in (k.output, *k.covers))
        if any(is_inplace(n) or (n.op == "call_function" and n.is_impure())
               for n in self.nodes[start:end] if n not in inside):
            return None
        return later

    def _movable(self, u: Node, inside: set, end: int, later: list) -> bool:
        """Whether ``u`` and whatever reads it before ``end`` are views no kernel of the run
        reads; they are added to ``later``."""
        if u in later:
            return True
        if u in self.kernel_of or not is_view(u) or is_inplace(u):
            return False
        later.append(u)
        return all(w not in inside and (self.made_at(w) >= end or
                                        self._movable(w, inside, end, later))
                   for w in self.readers(u))

    def move_after(self, last: Node, moved: list[Node]) -> None:
        """Move ``moved`` (in their graph order) right after ``last``."""
        at = last
        for n in sorted(moved, key=self.pos.__getitem__):
            at.append(n)
            at = n
        if moved:
            self.index()


def _chained(run: list[KernelStep], order: _Order) -> list[KernelStep]:
    """The run as one step, or as it was where the chain cannot be built."""
    outputs = {k.output: i for i, k in enumerate(run)}
    inside = {n for k in run for n in (k.output, *k.covers)}
    ext: list[Node] = []
    members = []
    for k in run:
        inputs = []
        for a in k.args:
            if order.source(a) in outputs:
                inputs.append(("mid", outputs[order.source(a)]))
            else:   # read from its own slot (an identity node's is its input's)
                if a not in ext:
                    ext.append(a)
                inputs.append(("ext", ext.index(a)))
        escapes = any(u not in inside for u in order.readers(k.output))
        members.append(Member(k.fn, k.fn.native, tuple(inputs), escapes))
    # a graph served by stand-ins (build.py's no-stall rule) does not wait on the chain's compile
    # either: where it is not built yet, the members run one by one
    stand_in = any(getattr(k.fn, "kwker_stand_in", False) for k in run)
    try:
        with kernel.compiling(False) if stand_in else contextlib.nullcontext():
            fn, why = make_kernel("make_chain", members)
    except Exception as e:  # noqa: BLE001 - the members still run, one step each
        fn, why = None, f"{type(e).__name__}: {e}"
    if fn is None:
        log.debug("kwker: chaining %s failed, they run one by one: %s",
                  ", ".join(k.name for k in run), why)
        return list(run)
    extra = [k.output for k in run[:-1] if members[outputs[k.output]].escapes]
    # identity nodes (no step) on an output only the run reads are its too
    aliases = [u for k in run for u in order.aliases(k.output)
               if all(r in inside for r in order.readers(u))]
    covers = list(dict.fromkeys(n for k in run for n in (k.output, *k.covers))) + aliases
    name = "chain(" + ", ".join(k.name for k in run) + ")"
    return [KernelStep(fn, ext, run[-1].output, covers, name, extra, [k.name for k in run])]
