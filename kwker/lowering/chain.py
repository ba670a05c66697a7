"""Runs of kernel steps made one native call (kernels/chain.py): a decoder layer's projection,
norm, MLP and the next layer's norm and q/k/v projection between two attentions.

Steps join a run in graph order while each kernel has a native form (``fn.native``), takes
tensors of the run's leading dims only, and nothing outside the run reads a member's output
before the run's last kernel, nor writes anything in between: the run's one step, placed where
its last kernel was, then computes what the members would have. Outputs read outside the run
become the step's extra values (``KernelStep.extra``); the rest live in the chain's scratch.
"""
from __future__ import annotations

import logging

from torch.fx import Node

from ..kernels.chain import Member
from .make import make_kernel
from .ops import is_inplace
from .runner import KernelStep
from .shapes import TensorMeta

log = logging.getLogger("kwker")
MIN_RUN = 2


def chain_kernels(steps: list[KernelStep], nodes: list[Node], metas: dict) -> list[KernelStep]:
    """``steps`` with each run of two or more chainable kernels replaced by one step."""
    pos = {n: i for i, n in enumerate(nodes)}
    out, run = [], []

    def close():
        out.extend(_chained(run, metas) if len(run) >= MIN_RUN else run)
        run.clear()

    for s in sorted(steps, key=lambda s: pos[s.output]):
        if not _chainable(s, metas):
            close()
            out.append(s)
            continue
        if run and not _extends(run, s, nodes, pos, metas):
            close()
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


def _extends(run: list[KernelStep], s: KernelStep, nodes: list[Node], pos: dict,
             metas: dict) -> bool:
    """Whether ``s`` can join ``run`` (module doc)."""
    lead = _lead(metas[run[0].output])
    if any(_lead(metas[n]) != lead for n in (*s.args, s.output)):
        return False
    inside = {n for k in (*run, s) for n in (k.output, *k.covers)}
    end = pos[s.output]
    for k in run:
        if any(u not in inside and pos[u] < end for u in k.output.users):
            return False
    start = min(pos[n] for k in run for n in (k.output, *k.covers))
    return not any(is_inplace(n) or (n.op == "call_function" and n.is_impure())
                   for n in nodes[start:end] if n not in inside)


def _chained(run: list[KernelStep], metas: dict) -> list[KernelStep]:
    """The run as one step, or as it was where the chain cannot be built."""
    outputs = {k.output: i for i, k in enumerate(run)}
    inside = {n for k in run for n in (k.output, *k.covers)}
    ext: list[Node] = []
    members = []
    for k in run:
        inputs = []
        for a in k.args:
            if a in outputs:
                inputs.append(("mid", outputs[a]))
            else:
                if a not in ext:
                    ext.append(a)
                inputs.append(("ext", ext.index(a)))
        escapes = any(u not in inside for u in k.output.users)
        members.append(Member(k.fn, k.fn.native, tuple(inputs), escapes))
    try:
        fn, why = make_kernel("make_chain", members)
    except Exception as e:  # noqa: BLE001 - the members still run, one step each
        fn, why = None, f"{type(e).__name__}: {e}"
    if fn is None:
        log.warning("kwker: chaining %s failed, they run one by one: %s",
                    ", ".join(k.name for k in run), why)
        return list(run)
    extra = [k.output for k in run[:-1] if any(u not in inside for u in k.output.users)]
    covers = list(dict.fromkeys(n for k in run for n in (k.output, *k.covers)))
    name = "chain(" + ", ".join(k.name for k in run) + ")"
    return [KernelStep(fn, ext, run[-1].output, covers, name, extra, [k.name for k in run])]
