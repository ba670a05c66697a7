"""Steps whose results depend only on the graph's constants and a few sizes, run once per sizes.

A decoder's step computes some tensors from nothing but its constants and the cache's length: a
Llama's rotary cos and sin (``arange`` from the length, the product by ``inv_freq``, ``cat``,
``cos``, ``sin``), GPT-2's position embedding (``arange``, then ``embedding`` of ``wpe``). They
cost a dispatch each, several times its warm price with the caches cold after the weights' stream
(an exported Llama decode token, Zen 5: ~60 us in 7 ATen steps), for values a later token at the
same position gives again. Here such a region of the program is one step: its results are kept
per value of the sizes it reads (and the versions of the constants, so a constant changed in
place is seen), and the region's own steps run only for sizes not seen before.

The region holds functional ATen ops (no in-place or random ones, tensor results) and the views
the program makes of them, reading only constants, sizes and each other. Its results must not
reach the graph's output or be changed in place by any step (the kept tensors are given again
on every hit), nor be views of what is; every step reading them must come after the region's
last step, where the one step stands. Results that would carry an autograd graph, or are larger
than ``MAX_BYTES``, are made on every call; those made under ``torch.inference_mode`` are kept
apart from the others.
"""
from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx import Node

from .ops import is_inplace, target_in
from .shapes import TensorMeta

MAX_BYTES = 16 << 20    # results kept per region, all forgotten past this; larger ones not kept
MIN_STEPS = 2           # a region of fewer steps is left as it is

_aten = torch.ops.aten
# nodes giving an int the region may be keyed by: reads of a tensor's sizes, and arithmetic on
# them
SHAPE_READS = {_aten.sym_size.int, _aten.sym_numel.default, _aten.sym_stride.int}
SIZE_OPS = SHAPE_READS | {torch.sym_sum, operator.add, operator.sub, operator.mul,
                          operator.floordiv, operator.mod, operator.neg}


def memoise(planned: list, owners: list, slot_of: dict, metas: dict | None,
            nodes: list[Node]) -> list:
    """``planned`` ((step, nodes read) per node of ``owners``, None for the output's entry, in
    order; ``nodes``: the whole graph's) with its regions of constant-and-size steps (module doc)
    replaced by one step each. A region may read an earlier one's results: it is keyed by the
    sizes and constants behind them."""
    if metas is None:
        return planned
    escaping = _escaping(nodes, slot_of)
    node_at = {slot_of[n]: n for n in slot_of if n.op in ("get_attr", "placeholder")}
    consts = {s for s, n in node_at.items() if n.op == "get_attr"}
    # slot -> the size and constant slots its value follows from
    roots = {s: frozenset((s,)) for s, n in node_at.items()
             if n.op == "get_attr" or _is_int(n, metas)}
    while True:
        region: list[int] = []
        known = dict(roots)
        for i, ((step, reads), n) in enumerate(zip(planned, owners)):
            if n is None or step is None or hasattr(step, "memo"):
                continue
            read = {slot_of[r] for r in reads}
            if _size_node(n, metas) and (n.target in SHAPE_READS or read <= roots.keys()):
                roots[slot_of[n]] = known[slot_of[n]] = frozenset((slot_of[n],))
                node_at[slot_of[n]] = n
            elif n not in escaping and _functional(n, step, metas) and read <= known.keys():
                region.append(i)
                known[slot_of[n]] = frozenset().union(*(known[r] for r in read))
        region = _closed(region, planned, owners, slot_of)
        if len(region) < MIN_STEPS:
            return planned
        behind = frozenset().union(*(known[slot_of[r]] for i in region
                                     for r in planned[i][1]))
        planned, results = _replaced(planned, owners, region, slot_of, node_at,
                                     sorted(behind - consts), sorted(behind & consts))
        roots.update((s, behind) for s in results)


def _escaping(nodes: list[Node], slot_of: dict) -> set[Node]:
    """The nodes whose memory a step changes in place or the graph gives out, and every node
    they may be views of (a kept tensor must not be reachable through either). A view is an ATen
    op whose schema says its result aliases its input, a step sharing its input's slot
    (runner.is_identity), or any op Kwker cannot read the schema of."""
    todo = []
    for n in nodes:
        if n.op == "output":
            todo += n.all_input_nodes
        elif is_inplace(n):
            todo += [a for a in (*n.args[:1], n.kwargs.get("out")) if isinstance(a, Node)]
    seen: set[Node] = set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op in ("call_function", "call_method") and m.args and \
                isinstance(m.args[0], Node) and _may_alias(m, slot_of):
            todo.append(m.args[0])
    return seen


def _may_alias(m: Node, slot_of: dict) -> bool:
    if m in slot_of and slot_of.get(m.args[0]) == slot_of[m]:
        return True
    if isinstance(m.target, torch._ops.OpOverload):
        return any(r.alias_info is not None for r in m.target._schema.returns)
    return True


def _is_int(n: Node, metas: dict) -> bool:
    return n in metas and not isinstance(metas[n], TensorMeta) and \
        not isinstance(metas[n], (bool, float))


def _size_node(n: Node, metas: dict) -> bool:
    return n.op == "call_function" and target_in(n, SIZE_OPS) and _is_int(n, metas)


def _functional(n: Node, step: Callable, metas: dict) -> bool:
    """Whether ``n``'s step computes a tensor from its arguments alone: a functional ATen op,
    or a view the program makes (views.py), not a kernel step."""
    if hasattr(step, "kernel") or not isinstance(metas.get(n), TensorMeta) or \
            metas[n].device != "cpu" or is_inplace(n) or any(is_inplace(u) for u in n.users):
        return False
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return False
    return not n.is_impure() and torch.Tag.nondeterministic_seeded not in n.target.tags


def _closed(region: list[int], planned: list, owners: list, slot_of: dict) -> list[int]:
    """``region`` less what may not be kept: results the output reads (and what reads them),
    and the steps from the first one that reads a result before the region ends. Reads are
    compared by slot: a step that gives back its input (runner.is_identity) shares its slot."""
    def slots(reads) -> set:
        return {slot_of[r] for r in reads}
    out_reads = set().union(*(slots(r) for (_, r), n in zip(planned, owners) if n is None))
    while region:
        bad = {slot_of[owners[i]] for i in region} & out_reads
        while True:   # and every region step reading one of them
            more = {slot_of[owners[i]] for i in region if slot_of[owners[i]] not in bad and
                    slots(planned[i][1]) & bad}
            if not more:
                break
            bad |= more
        region = [i for i in region if slot_of[owners[i]] not in bad]
        inside = {slot_of[owners[i]] for i in region}
        last = region[-1] if region else -1
        early = [j for j, (_, reads) in enumerate(planned) if j <= last and j not in region
                 and slots(reads) & inside]
        if not early:
            return region
        region = [i for i in region if i < early[0]]
    return region


def _replaced(planned: list, owners: list, region: list[int], slot_of: dict, node_at: dict,
              keys: list[int], versioned: list[int]) -> tuple[list, list[int]]:
    """(``planned`` with ``region``'s steps one step, at its last one's place, keyed by the
    values in the ``keys`` slots and the versions of the constants in ``versioned``; the slots
    of the results it gives)."""
    own = {slot_of[owners[i]] for i in region}
    steps = [planned[i][0] for i in region]
    outer = {r for i in region for r in planned[i][1] if slot_of[r] not in own}
    read_after = {slot_of[r] for j, (_, reads) in enumerate(planned) if j > region[-1]
                  for r in reads}
    results = sorted(own & read_after)
    scratch = sorted(own - read_after)
    kept: dict = {}
    held = [0]

    inference = torch.is_inference_mode_enabled

    def step(env):
        # tensors made under inference mode are kept apart from the others (they may not be
        # saved for backward outside it)
        key = (inference(), *[env[s] for s in keys], *[env[s]._version for s in versioned])
        hit = kept.get(key)
        if hit is None:
            for s in steps:
                s(env)
            hit = tuple(env[s] for s in results)
            for s in scratch:
                env[s] = None
            tensors = [t for t in hit if isinstance(t, torch.Tensor)]
            size = sum(t.numel() * t.element_size() for t in tensors)
            # too large (a long prompt's mask, say), or in an autograd graph (a constant that
            # requires grad, in training): made each time
            if size > MAX_BYTES or any(t.requires_grad for t in tensors):
                return
            if held[0] + size > MAX_BYTES:
                kept.clear()
                held[0] = 0
            kept[key] = hit
            held[0] += size
        else:
            for s, v in zip(results, hit):
                env[s] = v
    step.memo = kept
    at = set(region)
    out = [(None, ()) if i in at and i != region[-1] else entry
           for i, entry in enumerate(planned)]
    # it reads what its steps read from outside, and the sizes and constants keying it
    reads = outer | {node_at[s] for s in (*keys, *versioned)}
    out[region[-1]] = (step, sorted(reads, key=lambda r: slot_of[r]))
    return out, results
