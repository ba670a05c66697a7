"""Chains of view ops collapsed into one strided view each, for the flat eager runner.

Between a decoder's kernels sit chains of metadata-only ops: ``split`` of a fused q/k/v
projection, ``getitem``, ``view`` to heads, ``transpose``; after attention, ``transpose``,
``contiguous``, ``reshape``. Each is one ATen call, and in a decode step, where the kernels
before it have just streamed the weights through the caches, each costs 3-5 us: a GPT-2 layer
runs 16 of them. Where every size is static, the view a chain ends in is a fixed
(size, stride, offset) of the tensor it starts from, so the runner makes it with one
``as_strided`` call, and the chain's inner nodes, read by nothing else, get no step at all.

The views are worked out by running the ops themselves on meta tensors of the graph's recorded
shapes and strides: torch's own view rules, and an op that copies (a ``reshape`` or
``contiguous`` of a strided input) is seen to copy and ends the chain. At run time the start
tensor's shape and strides are checked against those recorded; if they differ, the chain's ops
run as written. Only ops that never write are taken (no in-place ops), and only with constant
arguments.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Node

from .shapes import TensorMeta, same_layout

METHODS = {"view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "contiguous",
           "flatten", "unflatten", "t", "narrow", "split", "chunk", "unbind", "expand", "select",
           "swapaxes", "movedim", "__getitem__"}
FUNCTIONS = {operator.getitem, torch.transpose, torch.reshape, torch.flatten, torch.split,
             torch.unsqueeze, torch.squeeze, torch.permute, torch.narrow, torch.select,
             torch.chunk, torch.unbind, torch.t, torch.swapaxes, torch.movedim}
# the same ops as ATen overloads, as an exported program (a package's graph) spells them
_aten = torch.ops.aten
FUNCTIONS |= {_aten.view.default, _aten.reshape.default, _aten.transpose.int,
              _aten.permute.default, _aten.unsqueeze.default, _aten.squeeze.dim,
              _aten.squeeze.dims, _aten.squeeze.default, _aten.split.Tensor,
              _aten.split_with_sizes.default, _aten.select.int, _aten.slice.Tensor,
              _aten.expand.default, _aten.t.default, _aten.alias.default, _aten.unflatten.int,
              _aten.flatten.using_ints, _aten.narrow.default, _aten.chunk.default,
              _aten.unbind.int, _aten.to.dtype}   # (``to`` only where it is the tensor itself)


@dataclass
class Chain:
    """How node values derive from ``root``: ``ops`` replays the chain on a tensor; ``meta``
    is its result on the root's meta tensor (a tensor, or a tuple of them for ``split``)."""
    root: Node
    root_meta: torch.Tensor
    ops: tuple
    meta: object


def _constant(a) -> bool:
    if isinstance(a, Node):
        return False
    if isinstance(a, (list, tuple)):
        return all(_constant(x) for x in a)
    if isinstance(a, slice):
        return all(_constant(x) for x in (a.start, a.stop, a.step))
    if isinstance(a, dict):
        return all(_constant(x) for x in a.values())
    return True


def _op(n: Node) -> Callable | None:
    """``fn(x)`` applying node ``n`` to its tensor argument, or None if ``n`` is not a view op
    with constant other arguments."""
    if not n.args or not isinstance(n.args[0], Node) or not _constant(n.args[1:]) or \
            not _constant(n.kwargs):
        return None
    rest, kw = n.args[1:], dict(n.kwargs)
    if n.op == "call_method" and n.target in METHODS:
        name = n.target
        return lambda x: getattr(x, name)(*rest, **kw)
    if n.op == "call_function" and n.target in FUNCTIONS:
        fn = n.target
        return lambda x: fn(x, *rest, **kw)
    return None


def is_static(meta) -> bool:
    return isinstance(meta, TensorMeta) and all(type(s) is int for s in meta.shape) and \
        all(type(s) is int for s in meta.stride)


def _aliases(res, root_meta: torch.Tensor) -> bool:
    if isinstance(res, (tuple, list)):
        return bool(res) and all(_aliases(r, root_meta) for r in res)
    return isinstance(res, torch.Tensor) and res.dtype == root_meta.dtype and (
        res is root_meta or res._base is root_meta)


def chains(nodes: list[Node], metas: dict, no_slot: set, kernel_out: set) -> dict[Node, Chain]:
    """The view nodes among ``nodes`` that derive from a tensor of static recorded layout by view
    ops alone, each with its chain. ``no_slot``: nodes a kernel covers (no value at run time);
    ``kernel_out``: the kernels' results (roots, not views)."""
    found: dict[Node, Chain] = {}
    for n in nodes:
        if n in no_slot or n in kernel_out or n.op not in ("call_method", "call_function"):
            continue
        op = _op(n)
        if op is None:
            continue
        src = n.args[0]
        parent = found.get(src)
        if parent is None:
            meta = metas.get(src)
            if src in no_slot or not is_static(meta):
                continue
            root_meta = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype,
                                            device="meta")
            parent = Chain(src, root_meta, (), root_meta)
        try:
            res = op(parent.meta)
        except Exception:  # noqa: BLE001 - not a view we can work out: the node runs as written
            continue
        if not _aliases(res, parent.root_meta):
            continue
        want = metas.get(n)
        if isinstance(res, torch.Tensor) and isinstance(want, TensorMeta) and (
                tuple(res.shape) != tuple(want.shape) or
                not same_layout(want.shape, res.stride(), want.stride)):
            continue
        found[n] = Chain(parent.root, parent.root_meta, parent.ops + (op,), res)
    return found


def collapse(nodes: list[Node], metas: dict | None, no_slot: set,
             kernel_out: set) -> tuple[dict, set]:
    """(node -> Chain for the views to make by one ``as_strided`` each, the view nodes that need
    no step: read only by views made from their chain's root)."""
    if not metas:
        return {}, set()
    found = chains(nodes, metas, no_slot, kernel_out)
    # a split read by anything but the getitems taken here runs as written
    found = {n: c for n, c in found.items()
             if isinstance(c.meta, torch.Tensor) or all(u in found for u in n.users)}
    skipped = {n for n in found if all(u in found for u in n.users)}
    return {n: c for n, c in found.items() if n not in skipped}, skipped


def maker(chain: Chain) -> Callable:
    """``make(root)``: the view of ``chain`` from ``root``, by one ``as_strided`` when the root
    is a plain tensor of its recorded shape and layout (the root itself where the chain changes
    nothing, as ``contiguous`` of a contiguous tensor gives it back), else by the chain's ops."""
    meta = chain.meta
    shape, stride = tuple(chain.root_meta.shape), chain.root_meta.stride()
    size, vstride, offset = tuple(meta.shape), meta.stride(), meta.storage_offset()
    ops, as_strided, itself = chain.ops, torch.Tensor.as_strided, meta is chain.root_meta
    plain = (torch.Tensor, torch.nn.Parameter)  # not a subclass (torchao's weights)
    seen = [stride]  # the last strides met at run time differing only on size-1 dims

    def make(x):
        st = x.stride()
        if x.shape == shape and type(x) in plain and (
                st == seen[0] or st == stride or
                same_layout(shape, st, stride) and not seen.__setitem__(0, st)):
            return x if itself else as_strided(x, size, vstride, x.storage_offset() + offset)
        for op in ops:
            x = op(x)
        return x
    return make


def make_step(chain: Chain, root_slot: int, out: int) -> Callable:
    """``step(env)``: the view of ``chain`` (``maker``) from the root's slot."""
    make = maker(chain)

    def step(env):
        env[out] = make(env[root_slot])
    step.strided = True
    return step
