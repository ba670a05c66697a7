"""Grouped-query attention written as repeated k/v heads (transformers' ``repeat_kv``,
``repeat_interleave``): found here so the attention kernel reads the unrepeated heads, h // r of
them, instead of r copies."""
from __future__ import annotations

import torch
from torch.fx import Node

from .autocast import cast_source
from .ops import op_name
from .shapes import TensorMeta

_VIEWS = ("getitem", "unsqueeze", "view", "reshape")


def repeated_kv(n: Node, metas) -> tuple[Node, list, torch.dtype | None] | None:
    """(the (B, Hkv, L, D) source, [the repeat's nodes], the dtype it is cast to or None) when
    ``n`` repeats each head of a 4-D k or v ``r`` times in place (head h reads source head
    h // r, as grouped-query attention): ``x[:, :, None].expand(B, Hkv, r, L, D).reshape(B,
    Hkv * r, L, D)`` (transformers' ``repeat_kv``; under autocast with its cast of the expanded
    heads before the reshape) or ``x.repeat_interleave(r, dim=1)``. Shapes decide, from the
    metas."""
    def shape(x):
        m = metas.get(x) if isinstance(x, Node) else None
        return m.shape if isinstance(m, TensorMeta) else None

    out = shape(n)
    if out is None or len(out) != 4 or not n.all_input_nodes:
        return None
    if op_name(n) == "repeat_interleave":
        src = n.args[0]
        s = shape(src)
        if s is not None and len(s) == 4 and s[0] == out[0] and s[2:] == out[2:] and \
                out[1] % s[1] == 0 and (n.kwargs.get("dim", n.args[2] if len(n.args) > 2
                                                      else None) in (1, -3)):
            return src, [n], None
        return None
    if op_name(n) not in ("reshape", "view"):
        return None
    ex, cast = n.args[0], None
    if cast_source(ex) is not None and len(ex.users) == 1:
        cast, ex = ex, cast_source(ex)
    if not isinstance(ex, Node) or op_name(ex) != "expand":
        return None
    slices = []
    un = _past_full_slices(ex.args[0], shape, slices)
    es, us = shape(ex), shape(un) if isinstance(un, Node) else None
    if es is None or us is None or len(es) != 5 or us[2] != 1 or \
            (es[0], es[1] * es[2], es[3], es[4]) != tuple(out) or \
            tuple(us) != (es[0], es[1], 1, es[3], es[4]) or op_name(un) not in _VIEWS:
        return None
    src = _past_full_slices(un.args[0], shape, slices)
    s = shape(src) if isinstance(src, Node) else None
    if s is None or tuple(s) != (es[0], es[1], es[3], es[4]):
        return None
    if cast is None:
        return src, [*slices, un, ex, n], None
    return src, [*slices, un, ex, cast, n], metas[cast].dtype


def _past_full_slices(x, shape, passed: list):
    """The first node up from ``x`` that is not a slice of everything (``x[:, :, None, :, :]``
    in an exported graph: ``aten.slice`` of 0 to the end, step 1, around the ``unsqueeze``),
    the slices passed appended to ``passed``."""
    while isinstance(x, Node) and op_name(x) == "slice" and x.args and \
            isinstance(x.args[0], Node) and not x.kwargs and \
            (x.args[2] if len(x.args) > 2 else None) in (None, 0) and \
            (x.args[4] if len(x.args) > 4 else 1) == 1 and \
            shape(x) is not None and shape(x) == shape(x.args[0]) and len(x.users) == 1:
        passed.append(x)
        x = x.args[0]
    return x
