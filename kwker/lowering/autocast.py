"""Autocast made explicit: casts in the graph where autocast would cast, for the nodes Kwker lowers.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` a ``linear`` of float32 tensors runs in
bf16: autocast casts its floating arguments (weights and bias included) to bf16 first. Kwker's
kernels do not consult autocast, so before matching, every lowerable node inside an autocast
region whose result dtype differs from its floating inputs' gets explicit ``.to(dtype)`` casts of
those inputs: the dtype shape propagation finds for the node (run under autocast, like the
graph) is what autocast decided, so the rule is autocast's own, whichever list (lower precision
or float32) the op is on. Propagation, not dynamo's metadata, because decomposed fused blocks
(decompose.py) are new nodes. Everything else in the region stays as it was and still
runs under autocast on the inner compiler.

A cast of a constant (a weight or bias) is marked, so matching reads the weight through it and the
kernel factory rounds it once, at build time, instead of every call.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from .ops import canon
from .report import LOWERABLE  # their inputs and result share one dtype unless autocast casts

CAST_FLAG = "kwker.autocast_cast"
SUPPORTED = (torch.bfloat16,)


def _is_enter(n: Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "_enter_autocast"


def _is_exit(n: Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "_exit_autocast"


def regions(graph: Graph) -> tuple[dict, str | None]:
    """({node under CPU autocast: its autocast dtype}, why the graph cannot be lowered or None).

    Ambient autocast (enabled around the compiled call) covers the whole graph; otherwise the
    nodes between ``_enter_autocast`` and its ``_exit_autocast``.
    """
    if torch.is_autocast_enabled("cuda"):
        return {}, "CUDA autocast is enabled"
    stack = []
    if torch.is_autocast_enabled("cpu"):
        stack.append(torch.get_autocast_dtype("cpu"))
        if stack[0] not in SUPPORTED:
            return {}, f"autocast to {stack[0]} (Kwker lowers bfloat16)"
    inside = {}
    for n in graph.nodes:
        if _is_enter(n):
            device, dtype, enabled = (list(n.args) + [None] * 3)[:3]
            if device != "cpu" and enabled:
                return {}, f"{device} autocast region"
            if enabled and dtype not in SUPPORTED:
                return {}, f"autocast to {dtype} (Kwker lowers bfloat16)"
            stack.append(dtype if enabled else None)
        elif _is_exit(n) and stack:
            stack.pop()
        elif stack and stack[-1] is not None:
            inside[n] = stack[-1]
    return inside, None


def _dtype(metas: dict, n) -> torch.dtype | None:
    m = metas.get(n) if isinstance(n, Node) else None
    if isinstance(m, (tuple, list)) and m:
        m = m[0]
    return getattr(m, "dtype", None)


def make_explicit(gm: GraphModule, metas: dict) -> int:
    """Insert the casts autocast would do before each lowerable node in a region (in place);
    ``metas``: node -> TensorMeta from shape propagation. Returns how many nodes got casts
    (propagate again if any: the casts are new nodes)."""
    inside, why = regions(gm.graph)
    if why is not None:
        raise ValueError(why)
    changed = 0
    made = {}   # (node, dtype) -> its cast, made once for all the nodes that read it
    replaced = set()
    for n in inside:
        if n.op not in ("call_function", "call_method") or canon(n) not in LOWERABLE:
            continue
        out = _dtype(metas, n)
        if out is None or not out.is_floating_point:
            continue
        casts = {}
        for a in n.all_input_nodes:
            dt = _dtype(metas, a)
            if dt is None or not dt.is_floating_point or dt == out or a in casts:
                continue
            with gm.graph.inserting_before(n):
                casts[a] = _cast(gm.graph, metas, a, out, made)
        if casts:
            n.args = torch.fx.node.map_arg(n.args, lambda x: casts.get(x, x))
            n.kwargs = torch.fx.node.map_arg(n.kwargs, lambda x: casts.get(x, x))
            changed += 1
            replaced.update(casts)
    for a in replaced:  # a view now cast at its source and viewed again: nothing reads it
        if not a.users and a.op == "call_method" and a.target in ("view", "reshape"):
            gm.graph.erase_node(a)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _cast(graph: Graph, metas: dict, a: Node, dtype: torch.dtype, made: dict) -> Node:
    """``a.to(dtype)``, marked, made once per node (BERT's q, k and v projections read one
    LayerNorm output: one cast, not three); a method view of ``a``'s source
    (``x.view(-1, K)``) is cast at the source and viewed again, the same values, so that the
    product still reads a view of an N-D tensor: transformers' Conv1D (``addmm(b, x.view(-1,
    K), w).view(...)``) under autocast then matches as the linear of ``x``, with its GELU or
    residual fused."""
    src = a.args[0] if a.op == "call_method" and a.target in ("view", "reshape") and \
        a.args and isinstance(a.args[0], Node) else None
    viewed = src is not None and _dtype(metas, src) == _dtype(metas, a)
    what = src if viewed else a
    c = made.get((what, dtype))
    if c is None:
        c = made[(what, dtype)] = graph.call_method("to", (what, dtype))
        c.meta[CAST_FLAG] = True
    return graph.call_method(a.target, (c, *a.args[1:]), dict(a.kwargs)) if viewed else c


def cast_source(n) -> Node | None:
    """The node an inserted autocast cast reads, or None if ``n`` is not one."""
    if isinstance(n, Node) and n.meta.get(CAST_FLAG):
        return n.args[0]
    return None
