"""What a graph computes from none of its inputs, computed once at compile time.

transformers builds its attention masks from ``arange``, comparisons and ``&`` of tensors whose
sizes dynamo traced as constants (GPT-2 at a fixed length: ~25 ATen calls per forward, every one
giving the same tensors). Such nodes (no placeholder or attribute among their ancestors, a
deterministic op, no in-place write, no tensor an in-place op later writes into) are evaluated
here, once, and their users read the result: a tensor becomes a graph attribute, a number or
tuple a literal argument.

An attention whose constant boolean mask is the causal pattern (``ones(L, S).tril()``, broadcast
over batch and heads) becomes ``is_causal=True`` without a mask: the same answer, and the kernel
skips the masked blocks instead of reading a mask.
"""
from __future__ import annotations

import logging
import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from .ops import is_inplace, is_view, written_args

log = logging.getLogger("kwker")
MAX_NUMEL = 1 << 22   # a folded tensor is kept with the compiled graph: masks, not weights
# ops whose results differ between calls, or that read uninitialised memory
_IMPURE = ("rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "randperm",
           "normal", "bernoulli", "multinomial", "poisson", "dropout", "empty", "empty_like",
           "empty_strided", "new_empty", "new_empty_strided", "uniform_", "exponential_")
_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
ATTR = "_kwker_folded_{}"
# Python's operators on tensors and numbers (``and_`` is not in-place, whatever its name says)
_OPERATORS = {getattr(operator, name) for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "invert",
    "and_", "or_", "xor", "not_", "eq", "ne", "lt", "le", "gt", "ge", "getitem")}


def _name(n: Node) -> str:
    return n.target if n.op == "call_method" else getattr(n.target, "__name__", str(n.target))


def _foldable(n: Node, values: dict) -> bool:
    if n.op not in ("call_function", "call_method"):
        return False
    if n.target not in _OPERATORS:
        name = _name(n)
        if is_inplace(n) or name in _IMPURE or name.startswith("_"):
            return False   # also dynamo's _enter_autocast / _set_grad_enabled and such
    return all(a in values for a in n.all_input_nodes)


def _evaluate(n: Node, values: dict):
    args = torch.fx.node.map_arg(n.args, values.__getitem__)
    kwargs = torch.fx.node.map_arg(n.kwargs, values.__getitem__)
    if n.op == "call_method":
        return getattr(args[0], n.target)(*args[1:], **kwargs)
    return n.target(*args, **kwargs)


def _small(v) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() <= MAX_NUMEL and not v.requires_grad
    if isinstance(v, (tuple, list)):
        return all(_small(x) for x in v)
    return isinstance(v, (int, float, bool, torch.dtype, torch.device, torch.Size)) or v is None


def fold_constants(gm: GraphModule) -> int:
    """Fold the graph's input-independent nodes in place; returns how many went."""
    values: dict = {}
    with torch.no_grad():
        for n in gm.graph.nodes:
            if not _foldable(n, values):
                continue
            try:
                v = _evaluate(n, values)
            except Exception:  # noqa: BLE001 - left to run as traced
                log.debug("kwker: not folding %s", n.name, exc_info=True)
                continue
            if _small(v):
                values[n] = v
    _drop_written(gm, values)
    if not values:
        return 0
    _causal_masks(gm, values)
    count, attrs = 0, sum(1 for k in dir(gm) if k.startswith(ATTR.format("")))
    for n, v in values.items():
        users = [u for u in n.users if u not in values]
        if not users:
            continue
        if isinstance(v, torch.Tensor):
            name = ATTR.format(attrs)
            attrs += 1
            gm.register_buffer(name, v, persistent=False)
            with gm.graph.inserting_before(n):
                n.replace_all_uses_with(gm.graph.get_attr(name), lambda u: u not in values)
        elif not isinstance(v, (tuple, list)) or not any(
                isinstance(x, torch.Tensor) for x in v):
            for u in users:
                u.args = torch.fx.node.map_arg(u.args, lambda a: v if a is n else a)
                u.kwargs = torch.fx.node.map_arg(u.kwargs, lambda a: v if a is n else a)
        else:
            continue   # a tuple holding tensors: its getitem users were folded or stay
        count += 1
    for n in reversed(list(values)):   # the folded nodes nothing reads any more
        if not n.users:
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return count


def _storage(v):
    """Where a tensor's memory starts (None for non-tensors and empty ones, which share none)."""
    if not isinstance(v, torch.Tensor) or v.untyped_storage().nbytes() == 0:
        return None
    return v.untyped_storage().data_ptr()


def _source_value(n, values: dict):
    """The folded node ``n`` is, or is a view (or no-op cast) of: an in-place write into ``n``
    writes into it."""
    while isinstance(n, Node) and n not in values and is_view(n) and n.args and \
            isinstance(n.args[0], Node):
        n = n.args[0]
    return n if n in values else None


def _drop_written(gm: GraphModule, values: dict) -> None:
    """Unfold what an in-place op that runs every call writes into: the value it writes (also
    through views that are not folded), every value sharing its memory, and whatever was
    computed from those, which may read them after the write. T5's relative position buckets:
    ``buckets = (pos > 0) * 16`` is input-independent, then ``buckets += where(...)`` (in
    place) would have added to the kept constant on every call."""
    written = {_storage(values[src]) for u in gm.graph.nodes if u not in values and
               is_inplace(u) for a in written_args(u)
               if (src := _source_value(a, values)) is not None}
    written.discard(None)
    if not written:
        return
    dropped = set()
    for n in list(values):   # graph order: an input's drop is known before its users
        if _storage(values[n]) in written or any(a in dropped for a in n.all_input_nodes):
            dropped.add(n)
            del values[n]


def _causal_masks(gm: GraphModule, values: dict) -> None:
    """An attention reading a folded boolean mask equal to the causal pattern: is_causal."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in _SDPA:
            continue
        mask = n.kwargs.get("attn_mask")   # (a mask passed by position is left as it is)
        m = values.get(mask) if isinstance(mask, Node) else None
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.dim() < 2 or \
                n.kwargs.get("is_causal"):
            continue
        rows, cols = m.shape[-2:]
        if rows < 2 or not torch.equal(m, torch.ones(rows, cols, dtype=torch.bool)
                                       .tril().expand_as(m)):
            continue
        n.kwargs = {**n.kwargs, "attn_mask": None, "is_causal": True}
