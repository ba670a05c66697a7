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

import math

import torch
from torch.fx import Node

from ..kernels._call import kernel_dtype
from ..kernels.kv_cache import FixedView, make_kv_append
from . import views
from .gqa import repeated_kv
from .make import make_kernel, mark_generic
from .ops import bind, canon
from .patterns import Match
from .runner import KernelStep
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


def attend_appends(steps: list[KernelStep], nodes: list, metas: dict) -> list[KernelStep]:
    """``steps`` with each generic attention (no mask) whose keys and values come straight from
    two appends along the rows of 4-D caches made one step with them
    (``kernels/kv_cache.make_append_attend``): a decoder layer's three steps, and the views of
    the q/k/v projection that q and the new rows are, which that step reads in place from
    their root. The appends' results stay the graph's outputs, given by the same step. Where q
    and the new keys are the rotary embeddings (rope steps) of two such views by one cos and sin,
    the step rotates them itself (``_ropes``)."""
    by_output = {s.output: s for s in steps}
    order = {n: i for i, n in enumerate(nodes)}
    covered = {c for s in steps for c in s.covers} - set(by_output)
    found = views.chains(nodes, metas, covered, set(by_output))
    fused, gone = [], set()
    for s in steps:
        made = _fused(s, by_output, order, found, metas) if s.name == "sdpa" else None
        if made is not None:
            step, absorbed = made
            fused.append(step)
            gone.update(id(x) for x in absorbed)
            gone.add(id(s))
    return [s for s in steps if id(s) not in gone] + fused


def _append_of(node, by_output: dict, metas: dict):
    """The append step whose result ``node`` is, along the rows of a 4-D cache, or None."""
    step = by_output.get(node)
    if step is None or step.name != "kv_append":
        return None
    meta, b = metas.get(node), bind(node)
    return step if isinstance(meta, TensorMeta) and len(meta.shape) == 4 and b is not None \
        and b["dim"] % 4 == 2 else None


def _fused(s: KernelStep, by_output: dict, order: dict, found: dict, metas: dict):
    if len(s.args) != 3 or getattr(s.fn, "dims", None) is None:
        return None
    q, k, v = s.args
    ak, av = _append_of(k, by_output, metas), _append_of(v, by_output, metas)
    om = metas.get(s.output)
    if ak is None or av is None or ak is av or not views.is_static(om) or om.stride[-1] != 1 \
            or len(om.shape) != 4:
        return None
    covers = set(s.covers) | {s.output, k, v}
    result, output = _result_view(s.output, found, om), s.output
    if result is not None:   # the step gives the view, its own output's memory
        output, path = result
        covers.update(path)
    # the appends' results: read by the attention and, after it, by anything (the output)
    if any(u not in covers and order[u] < order[output] for x in (k, v) for u in x.users):
        return None
    absorbed = [ak, av]
    ropes = _ropes(by_output.get(q), by_output.get(ak.args[1]), s, ak)
    operands = [q, ak.args[1], av.args[1]]
    if ropes is not None:   # q and the new keys before their rotations, then cos and sin
        absorbed += ropes
        operands = [ropes[0].args[0], ropes[1].args[0], av.args[1], *ropes[0].args[1:]]
        covers.update(c for r in ropes for c in (*r.covers, r.output))
    paths = [_path(x, found) for x in operands]
    while True:   # of each view, the nodes from it back that only this step reads
        inside = covers | {n for p in paths if p for n in p}
        keep = [_only_read_by(p, inside) for p in paths]
        if keep == paths:
            break
        paths = keep
    fixed, args = [], []
    for x, path in zip(operands, paths):
        if path is None:
            fixed.append(None)
            args.append(x)
            continue
        chain = found[x]
        meta = chain.meta
        fixed.append(FixedView(tuple(chain.root_meta.shape), chain.root_meta.stride(),
                               tuple(meta.shape), meta.stride(), meta.storage_offset(),
                               views.maker(chain)))
        args.append(chain.root)
        covers.update(path)
    made = None
    if result is not None:
        chain = found[output]
        made = FixedView(tuple(om.shape), tuple(om.stride), tuple(chain.meta.shape),
                         chain.meta.stride(), 0, views.maker(chain))
    rope = (ropes[0].fn, *fixed[3:]) if ropes is not None else None
    # the grown caches' views made with the graph's output where only it reads them
    deferred = all(u in covers or u.op == "output" for x in (k, v) for u in x.users)
    fn, _ = make_kernel("make_append_attend", s.fn, tuple(fixed[:3]), tuple(om.shape),
                        tuple(om.stride), made, rope, deferred)
    if fn is None:
        return None
    return KernelStep(fn, [args[0], ak.args[0], args[1], av.args[0], *args[2:]], output,
                      [n for n in order if n in covers],
                      "rope_sdpa_kv_append" if ropes else "sdpa_kv_append", [k, v],
                      deferred=deferred), absorbed


def _ropes(rq: KernelStep | None, rk: KernelStep | None, attention: KernelStep,
           append: KernelStep) -> list | None:
    """[q's rope step, the new keys'] where attention's q is a rope step's result that only it
    reads, the keys' append's new rows one that only the append reads, both by one cos and sin
    and of the attention's dtype (the step rotates them with the same kernel), else None."""
    if rq is None or rk is None or rq.name != "rope" or rk.name != "rope" or \
            rq.args[1:] != rk.args[1:]:
        return None
    spec, (_, _, e, _, dtype) = getattr(rq.fn, "spec", None), attention.fn.dims
    if spec is None or rq.fn is not rk.fn and \
            getattr(rk.fn, "spec", None) != spec or spec.x or spec.d != e or \
            spec.dtype != kernel_dtype(dtype, "rope"):
        return None
    if not set(rq.output.users) <= {attention.output, *attention.covers} or \
            set(rk.output.users) != {append.output}:
        return None
    return [rq, rk]


def _result_view(out: Node, found: dict, om: TensorMeta) -> tuple | None:
    """(the last node, every node) of the chain of views that alone reads attention's output
    and makes of its memory one contiguous tensor from its first element (after a decode
    step's attention, ``transpose`` and ``reshape`` to the (B, 1, H * E) row the output
    projection reads), or None: the step then gives that row itself, one step and one view fewer
    a layer."""
    numel = math.prod(om.shape)
    if not numel or 1 + sum((d - 1) * st for d, st in zip(om.shape, om.stride)) != numel:
        return None   # the output's memory is not exactly its elements
    best = None
    for end, chain in found.items():
        meta = chain.meta
        if chain.root is not out or not isinstance(meta, torch.Tensor) or \
                not meta.is_contiguous() or meta.storage_offset() or meta.numel() != numel:
            continue
        path = [end]
        while path[-1].args[0] is not out:
            path.append(path[-1].args[0])
        inner = set(path) - {end}
        if all(u in inner or u is end for u in out.users) and \
                all(u in path for n in inner for u in n.users) and \
                (best is None or len(path) > len(best[1])):
            best = (end, path)
    return best


def _only_read_by(path: list | None, inside: set) -> list | None:
    """The nodes of ``path`` (a view back towards its root) up to the first that a node outside
    ``inside`` reads (a view shared with other layers, as the ``to`` of cos that each layer's
    ``unsqueeze`` reads: the step reads the root in place, the others read their own), or
    None if the view itself is read outside."""
    for i, n in enumerate(path or ()):
        if not all(u in inside for u in n.users):
            return path[:i] or None
    return path


def _path(node, found: dict) -> list | None:
    """The view nodes from ``node`` back to its chain's root (root excluded), or None."""
    chain = found.get(node)
    if chain is None or not isinstance(chain.meta, torch.Tensor) or chain.meta.dim() != 4 or \
            chain.meta.stride(3) != 1:    # rows read (and copied) as contiguous runs
        return None
    path = [node]
    while path[-1].args[0] is not chain.root:
        path.append(path[-1].args[0])
    return path
