"""torchao's quantised weights in an exported program, as linears of the weights themselves.

``torch.export`` takes torchao's weight tensors apart: each use reads their parts
(``export.access_subclass_inner_tensor``) and computes with them the way torchao writes its
linears (torchao 0.18):

- IntxUnpackedToInt8Tensor, and Int8Tensor in groups: ``dequantize_affine(qdata, block, scale,
  zero_point, ...)`` makes the dense weight, which ``linear`` uses (or ``mm`` its transpose);
- Int8Tensor per output channel: ``mm(x, qdata.t().to(dtype)) * scale.flatten()``.

``desugar`` rewrites each such use into ``aten.linear(x, weight)`` of the quantised parameter
itself, so the program holds ATen ops only and its lowering finds low-bit linears, as it does
under ``torch.compile``. A part used any other way is refused (ExportError naming the node).
"""
from __future__ import annotations

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten
CASTS = {aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.contiguous.default}
RESHAPES = {aten.flatten.using_ints, aten.reshape.default, aten.view.default}
ASSERTS = {aten._assert_tensor_metadata.default}


class LowbitExportError(ValueError):
    """A quantised weight used otherwise than as a linear's weight."""


def _is_call(n, targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _source(n, through=CASTS) -> tuple[object, int]:
    """(the node ``n`` is a cast or transpose of, transposes on the way mod 2)."""
    flips = 0
    while isinstance(n, Node) and n.op == "call_function":
        if n.target in through:
            n = n.args[0]
        elif n.target == aten.t.default or (n.target == aten.transpose.int and
                                            {d % 2 for d in n.args[1:3]} == {0, 1}):
            flips ^= 1
            n = n.args[0]
        else:
            break
    return n, flips


def _part(n, params: set, name: str) -> Node | None:
    """The quantised parameter whose part ``name`` node ``n`` reads, else None."""
    # looked up here, not at import: torch.export defines the op (loading a package never
    # gets this far, and never needs torch.export)
    access = torch.ops.export.access_subclass_inner_tensor.default
    if _is_call(n, {access}) and n.args[0] in params and n.args[1] == name:
        return n.args[0]
    return None


def _dequantised(n, params: set) -> Node | None:
    """The parameter a torchao ``dequantize_affine`` node dequantises, else None."""
    if isinstance(n, Node) and n.op == "call_function" and \
            str(getattr(n.target, "__name__", n.target)).startswith("dequantize_affine") and \
            "torchao" in str(n.target):
        return _part(n.args[0], params, "qdata")
    return None


def _weight_of(n: Node, params: set) -> tuple[Node, Node, Node] | None:
    """(node replaced, x, parameter) when ``n`` computes ``x @ deq(parameter).T``."""
    if n.target == aten.linear.default:
        src, flips = _source(n.args[1])
        p = _dequantised(src, params)
        return (n, n.args[0], p) if p is not None and not flips else None
    if n.target != aten.mm.default:
        return None
    src, flips = _source(n.args[1])
    if not flips:
        return None
    p = _dequantised(src, params)
    if p is not None:
        return n, n.args[0], p
    p = _part(src, params, "qdata")   # per channel: the scale multiplies the product
    users = list(n.users)
    if p is None or len(users) != 1 or not _is_call(users[0], {aten.mul.Tensor}) or \
            users[0].args[0] is not n:
        return None
    scale, _ = _source(users[0].args[1], CASTS | RESHAPES)
    return (users[0], n.args[0], p) if _part(scale, params, "scale") is p else None


def desugar(graph: Graph, quantized: set[str]) -> None:
    """Rewrite, in place, every use of the placeholders named in ``quantized`` (torchao
    weights) into ``aten.linear(x, weight)``; LowbitExportError for any other use."""
    params = {n for n in graph.nodes if n.op == "placeholder" and n.name in quantized}
    if not params:
        return
    for n in list(graph.nodes):
        if n.op != "call_function" or n._erased:  # erased by an earlier rewrite: a product
            continue                                 # it scaled, reshapes around rows
        found = _weight_of(n, params)
        if found is None:
            continue
        old, x, p = found
        args = (x, p) if old.target != aten.linear.default else (x, p, *old.args[2:3])
        with graph.inserting_before(old):
            new = graph.call_function(aten.linear.default, args)
        new.meta = dict(old.meta)
        product = old.args[0] if old.target == aten.mul.Tensor else None  # the unscaled one
        old.replace_all_uses_with(new)
        graph.erase_node(old)
        if product is not None:
            graph.erase_node(product)
        if len(new.args) == 2:   # torchao's Int8Tensor: a product of rows, reshaped back
            _tidy_rows(graph, new)
    _drop_unused_parts(graph, params)


def _tidy_rows(graph: Graph, lin: Node) -> None:
    """torchao's Int8Tensor multiplies rows and reshapes the product back to the input's rank,
    then adds the bias (if any) and casts to the dtype it has: ``to(add_(reshape(linear(
    reshape(x, (-1, K)), w)), bias))`` becomes ``linear(x, w, bias)``, so the bias is the
    kernel's epilogue and an activation or residual after it fuses too."""
    users = list(lin.users)
    if len(users) != 1 or not _is_call(users[0], RESHAPES) or users[0].args[0] is not lin:
        return
    shaped, out = users[0], lin.meta.get("val")
    _fold_bias(graph, lin, shaped, out)
    for user in list(shaped.users):   # the cast to the dtype it has, and the assert on that
        if _is_call(user, ASSERTS):
            graph.erase_node(user)
        elif _is_call(user, {aten.to.dtype}) and isinstance(out, torch.Tensor) and \
                user.args[1:] == (out.dtype,) and not user.kwargs:
            user.replace_all_uses_with(shaped)
            graph.erase_node(user)
    _unflatten(graph, lin, shaped)


def _fold_bias(graph: Graph, lin: Node, shaped: Node, out) -> None:
    """``add_(shaped, bias)`` of a 1-D parameter of the output's width into ``lin``."""
    adds = list(shaped.users)
    if len(adds) != 1 or not _is_call(adds[0], {aten.add_.Tensor, aten.add.Tensor}) or \
            adds[0].args[0] is not shaped or adds[0].kwargs:
        return
    bias = adds[0].args[1]
    val = getattr(bias, "meta", {}).get("val")
    if not (isinstance(bias, Node) and bias.op == "placeholder" and
            isinstance(val, torch.Tensor) and isinstance(out, torch.Tensor) and
            val.dim() == 1 and val.shape[0] == out.shape[-1] and val.dtype == out.dtype):
        return
    lin.args = (*lin.args, bias)
    adds[0].replace_all_uses_with(shaped)
    graph.erase_node(adds[0])


def _unflatten(graph: Graph, lin: Node, shaped: Node) -> None:
    """``reshape(linear(reshape(x, (-1, K)), w, b), (*lead, N))`` -> ``linear(x, w, b)``: the
    linear of x as it is, as torchao's other formats write it."""
    rows = lin.args[0]
    if not _is_call(rows, RESHAPES) or len(rows.users) != 1:
        return
    x = rows.args[0]
    xv, sv = getattr(x, "meta", {}).get("val"), shaped.meta.get("val")
    if not (isinstance(xv, torch.Tensor) and isinstance(sv, torch.Tensor) and
            xv.dim() == sv.dim() and str(tuple(xv.shape[:-1])) == str(tuple(sv.shape[:-1]))):
        return
    with graph.inserting_before(shaped):
        new = graph.call_function(aten.linear.default, (x, *lin.args[1:]))
    new.meta = dict(shaped.meta)
    shaped.replace_all_uses_with(new)
    graph.erase_node(shaped)
    graph.erase_node(lin)
    graph.erase_node(rows)


def _drop_unused_parts(graph: Graph, params: set) -> None:
    """Erase what only served the rewritten uses: the parts, their casts and dequantisation,
    and the metadata asserts on them; LowbitExportError if a part still has a user."""
    derived = set(params)
    for n in graph.nodes:
        if n.op == "call_function" and n not in derived and n.all_input_nodes and \
                all(a in derived for a in n.all_input_nodes) and n.target not in ASSERTS:
            derived.add(n)
    for n in list(graph.nodes):
        if _is_call(n, ASSERTS) and n.all_input_nodes and n.all_input_nodes[0] in derived:
            graph.erase_node(n)
    graph.eliminate_dead_code()   # the replaced products' inputs, then the parts
    left = [n for n in graph.nodes if n in derived and n.op == "call_function"]
    if left:
        used = next(((n, u) for n in left for u in n.users if u not in derived),
                    (left[-1], left[-1]))
        weight = next(a for a in _ancestors(left[0]) if a in params)
        raise LowbitExportError(
            f"node {used[1].name} ({used[1].target}) uses the quantised weight {weight.name} "
            f"(through {used[0].name}) other than as a linear's weight; packages take "
            "torchao's weights in linears only")


def _ancestors(n: Node):
    while n.all_input_nodes:
        n = n.all_input_nodes[0]
        yield n
