"""Attention masks that mask nothing, recognised from how they are computed.

An exported graph (``torch.export``, a package) computes transformers' masks where dynamo's graph
has none: its masking code skips the mask for a lone query only when not tracing. Attention
given such a mask reads it for every key; recognised, it runs unmasked, as under dynamo.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from .ops import op_name
from .shapes import TensorMeta

# ops that only select, repeat or rearrange values: an index tensor's values stay among its own
_MASK_VIEWS = ("unsqueeze", "view", "reshape", "expand", "alias", "slice", "select")


def every_key_visible(mask: Node, q_meta) -> bool:
    """Whether a bool attention mask lets a lone query see every key: transformers' causal mask
    for a decode step as an exported graph computes it (its mask is skipped under dynamo),
    ``kv_idx <= q_idx`` with ``kv_idx = arange(P + 1)`` and ``q_idx = arange(1) + P`` for a
    past of length ``P``: views of ``le(keys, query)`` whose keys run from 0 to one below
    ``P + 1`` and whose query is ``P``, the same ``P`` node."""
    if not isinstance(q_meta, TensorMeta) or len(q_meta.shape) < 2 or q_meta.shape[-2] != 1:
        return False
    le = _through(mask, _MASK_VIEWS)
    if not (isinstance(le, Node) and le.target is torch.ops.aten.le.Tensor):
        return False
    keys, query = (_arange_plus(_without_zero(_through(a, _MASK_VIEWS))) for a in le.args[:2])
    if keys is None or query is None or keys[1] != 0 or query[0] != 1:
        return False
    end, past = keys[0], query[1]    # keys 0 .. end - 1; the query at ``past``
    return isinstance(past, Node) and (
        isinstance(end, Node) and end.target is operator.add and
        tuple(end.args) in ((past, 1), (1, past)) or
        past.target is operator.sub and tuple(past.args) == (end, 1))


def _without_zero(n):
    """``n`` past additions and subtractions of 0."""
    while isinstance(n, Node) and n.target in (torch.ops.aten.add.Tensor,
                                               torch.ops.aten.sub.Tensor) and \
            len(n.args) == 2 and not n.kwargs and type(n.args[1]) is int and n.args[1] == 0:
        n = n.args[0]
    return n


def _through(n, ops: tuple):
    while isinstance(n, Node) and op_name(n) in ops and n.args:
        n = n.args[0]
    return n


def _arange_plus(n) -> tuple | None:
    """(end, offset) of ``arange(end) + offset`` (offset 0 for a bare ``arange``), or None."""
    offset = 0
    if isinstance(n, Node) and n.target is torch.ops.aten.add.Tensor and len(n.args) == 2 and \
            not n.kwargs:
        n, offset = n.args
    if isinstance(n, Node) and n.target is torch.ops.aten.arange.default and len(n.args) == 1:
        return n.args[0], offset
    if isinstance(n, Node) and n.target is torch.ops.aten.arange.start and \
            len(n.args) == 2 and n.args[0] == 0:
        return n.args[1], offset
    return None
