"""KV caches appended in place: ``cat([past, new], dim)`` whose result leaves the graph.

A decoder with a cache (transformers' ``DynamicCache``) concatenates each layer's past keys and
values with the step's new ones; dynamo's graph returns the result, which the cache keeps and
the next step passes back in. ``kernels/kv_cache.make_kv_append`` returns the same values as a
view into a buffer with spare room and writes the next step's rows after it, so the past is not
copied every token.

Its views have the buffer's strides, not the contiguous ones ``cat`` gives, so the match is
taken only where every reader of the result reads any strides: the graph's output (the caller)
and attention's keys and values (ATen's, or Kwker's attention kernels, which read strides or
copy). Only the flat program (``inner="eager"``) takes it: Inductor's code assumes the layouts
it was compiled for.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from ..kernels.kv_cache import make_kv_append
from .gqa import repeated_kv
from .make import mark_generic
from .ops import bind, canon
from .patterns import Match
from .shapes import TensorMeta


def _reads_any_strides(user: Node, cat: Node, metas: dict) -> bool:
    if user.op == "output":
        return True
    if canon(user) != "sdpa":
        return _repeated_for_attention(user, cat, metas)
    b = bind(user)
    return b is not None and b["query"] is not cat and b["attn_mask"] is not cat


def _repeated_for_attention(user: Node, cat: Node, metas: dict) -> bool:
    """Whether ``user`` begins grouped-query attention's repeat of ``cat``'s heads
    (``gqa.repeated_kv``: view ops and a reshape, as an exported graph spells ``repeat_kv``)
    whose result only attention reads, as keys or values: Kwker's attention kernel then reads
    the unrepeated heads at their strides, and ATen's ops, should it run them, read any."""
    n = user
    for _ in range(6):
        found = repeated_kv(n, metas)
        if found is not None:
            src, chain, _ = found
            return src is cat and user in chain and \
                all(canon(u) == "sdpa" and _reads_any_strides(u, n, metas) for u in n.users)
        if len(n.users) != 1:
            return False
        n = next(iter(n.users))
    return False


def append_matches(nodes: list, metas: dict, consts: set, claimed: set) -> list[Match]:
    """A match per ``cat`` of a graph input (the past; not a parameter in ``consts``) and a
    tensor of its dtype, that the graph returns and that only attention reads besides (nodes in
    ``claimed`` belong to other kernels)."""
    found = []
    for n in nodes:
        if n in claimed or canon(n) != "cat":
            continue
        b = bind(n)
        if b is None or not isinstance(b["dim"], int) or not isinstance(b["tensors"], (list,
                                                                                      tuple)):
            continue
        parts = b["tensors"]
        if len(parts) != 2 or not all(isinstance(p, Node) for p in parts):
            continue
        out, past, new = (metas.get(x) for x in (n, *parts))
        if not all(isinstance(m, TensorMeta) for m in (out, past, new)) or \
                not out.dtype == past.dtype == new.dtype:
            continue
        # the past comes from the caller (a tensor made in the graph is never a buffer's view),
        # or is the empty 1-D tensor a cache starts from (folded to a constant), which cat skips
        start = tuple(past.shape) == (0,)
        if not (parts[0].op == "placeholder" and parts[0] not in consts or
                start and parts[0].op == "get_attr") or \
                len(past.shape) != len(new.shape) and not start:
            continue
        rank = len(out.shape)
        if not -rank <= b["dim"] < rank:
            continue
        users = list(n.users)
        if not any(u.op == "output" for u in users) or \
                not all(_reads_any_strides(u, n, metas) for u in users):
            continue
        found.append(Match("kv_append", n, [n], {"past": parts[0], "new": parts[1]},
                           {"dim": b["dim"] % rank}))
    return found


def build_append(m: Match):
    """The append for ``m``: one callable serves every size."""
    return mark_generic(make_kv_append(m.params["dim"]), True)


_SIZE_READS = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_size.default)


def any_stride_inputs(nodes: list, kernels: list) -> set[str]:
    """Names of the graph inputs that may be taken at any strides: those read only as the past
    of a KV append (``kernels``: a report's, whose covered node names say which cats are
    appends) or for their sizes. A package keeps them as given, so the view of a buffer with
    spare room the previous call returned is appended to in place, not copied contiguous
    first (every other input is, as the kernels were built for contiguous ones)."""
    appends = {name for kernel, covers, *_ in kernels if kernel == "kv_append" for name in covers}
    out = set()
    for n in nodes:
        if n.op != "placeholder" or not n.users:
            continue
        if all(u.target in _SIZE_READS or
               u.name in appends and (bind(u) or {}).get("tensors", [None])[0] is n
               for u in n.users):
            out.add(n.name)
    return out
