"""What an FX node computes, independent of how dynamo spelled it.

Dynamo records the same operation in several forms: ``x @ w`` is ``operator.matmul``,
``x.matmul(w)`` a ``call_method``, ``torch.matmul`` a builtin; ``F.relu`` stays a Python function
while ``x.relu()`` is a method. ``canon(node)`` maps all of them to one name and ``bind(node)``
to one argument dictionary, so the patterns are written once.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

_REQ = object()  # marks a required argument

# canonical name -> (positional parameter names, defaults for the optional ones)
SIGNATURES: dict[str, tuple[tuple[str, ...], dict]] = {
    "linear": (("input", "weight", "bias"), {"bias": None}),
    "matmul": (("input", "other"), {}),
    "mm": (("input", "mat2"), {}),
    "bmm": (("input", "mat2"), {}),
    "addmm": (("input", "mat1", "mat2"), {"beta": 1, "alpha": 1}),
    "gelu": (("input",), {"approximate": "none"}),
    "layer_norm": (("input", "normalized_shape", "weight", "bias", "eps", "cudnn_enable"),
                   {"weight": None, "bias": None, "eps": 1e-5, "cudnn_enable": True}),
    "rms_norm": (("input", "normalized_shape", "weight", "eps"), {"weight": None, "eps": None}),
    "relu": (("input", "inplace"), {"inplace": False}),
    "silu": (("input", "inplace"), {"inplace": False}),
    "sigmoid": (("input",), {}),
    "tanh": (("input",), {}),
    "add": (("input", "other"), {"alpha": 1}),
    "sdpa": (("query", "key", "value", "attn_mask", "dropout_p", "is_causal"),
             {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None,
              "enable_gqa": False}),
    "topk": (("input", "k", "dim", "largest", "sorted"),
             {"dim": -1, "largest": True, "sorted": True}),
    "sort": (("input", "dim", "descending"), {"dim": -1, "descending": False, "stable": False}),
    "kthvalue": (("input", "k", "dim", "keepdim"), {"dim": -1, "keepdim": False}),
    "mode": (("input", "dim", "keepdim"), {"dim": -1, "keepdim": False}),
    "median": (("input", "dim", "keepdim"), {"dim": None, "keepdim": False}),
    "nanmedian": (("input", "dim", "keepdim"), {"dim": None, "keepdim": False}),
    "quantile": (("input", "q", "dim", "keepdim"),
                 {"dim": None, "keepdim": False, "interpolation": "linear"}),
    "nanquantile": (("input", "q", "dim", "keepdim"),
                    {"dim": None, "keepdim": False, "interpolation": "linear"}),
    "argsort": (("input", "dim", "descending"), {"dim": -1, "descending": False,
                                                 "stable": False}),
    "msort": (("input",), {}),
    "t": (("input",), {}),
    "transpose": (("input", "dim0", "dim1"), {}),
    "dropout": (("input", "p", "training", "inplace"),
                {"p": 0.5, "training": True, "inplace": False}),
    "cat": (("tensors", "dim"), {"dim": 0}),
    "grouped_mm": (("input", "mat2", "offs", "bias", "out_dtype"),
                   {"offs": None, "bias": None, "out_dtype": None}),
}

_FUNCTIONS = {
    torch._C._nn.linear: "linear",
    operator.matmul: "matmul", torch.matmul: "matmul",
    torch.mm: "mm", torch.bmm: "bmm", torch.addmm: "addmm",
    torch._C._nn.gelu: "gelu",
    F.layer_norm: "layer_norm", torch.layer_norm: "layer_norm",
    F.rms_norm: "rms_norm", torch.rms_norm: "rms_norm",
    torch.relu: "relu", F.relu: "relu", F.silu: "silu",
    torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid", torch.tanh: "tanh", F.tanh: "tanh",
    operator.add: "add", torch.add: "add",
    torch._C._nn.scaled_dot_product_attention: "sdpa",
    torch.topk: "topk", torch.sort: "sort", torch.kthvalue: "kthvalue", torch.mode: "mode",
    torch.median: "median", torch.nanmedian: "nanmedian", torch.quantile: "quantile",
    torch.nanquantile: "nanquantile", torch.argsort: "argsort", torch.msort: "msort",
    torch.t: "t", torch.transpose: "transpose",
    F.dropout: "dropout", torch.dropout: "dropout",
    torch.cat: "cat", torch.concat: "cat", torch.concatenate: "cat",
    torch._grouped_mm: "grouped_mm", F.grouped_mm: "grouped_mm",
}

# the same operations as ATen overloads, as ``torch.export`` records them (packages)
_aten = torch.ops.aten
_FUNCTIONS.update({
    _aten.linear.default: "linear", _aten.matmul.default: "matmul", _aten.mm.default: "mm",
    _aten.bmm.default: "bmm", _aten.addmm.default: "addmm", _aten.gelu.default: "gelu",
    _aten.layer_norm.default: "layer_norm", _aten.rms_norm.default: "rms_norm",
    _aten.relu.default: "relu", _aten.silu.default: "silu", _aten.add.Tensor: "add",
    _aten.sigmoid.default: "sigmoid", _aten.tanh.default: "tanh",
    _aten.scaled_dot_product_attention.default: "sdpa",
    _aten.topk.default: "topk", _aten.sort.default: "sort", _aten.sort.stable: "sort",
    _aten.kthvalue.default: "kthvalue", _aten.mode.default: "mode",
    _aten.median.default: "median", _aten.median.dim: "median",
    _aten.nanmedian.default: "nanmedian", _aten.nanmedian.dim: "nanmedian",
    _aten.quantile.default: "quantile", _aten.quantile.scalar: "quantile",
    _aten.nanquantile.default: "nanquantile", _aten.nanquantile.scalar: "nanquantile",
    _aten.argsort.default: "argsort", _aten.argsort.stable: "argsort",
    _aten.msort.default: "msort", _aten.t.default: "t", _aten.transpose.int: "transpose",
    _aten.dropout.default: "dropout", _aten.cat.default: "cat",
    _aten._grouped_mm.default: "grouped_mm",
})

# Other libraries' custom ops that mean one of ours, by qualified name (not imported here):
# transformers' MoE layers call their own grouped matmul under ``torch.compile`` in float32
# (``torch._grouped_mm`` in bf16), with ``_grouped_mm``'s arguments and meaning
_NAMED_OPS = {"transformers::grouped_mm_fallback": "grouped_mm"}

_METHODS = {
    "matmul": "matmul", "__matmul__": "matmul", "mm": "mm", "bmm": "bmm", "addmm": "addmm",
    "relu": "relu", "add": "add", "__add__": "add", "__radd__": "add",
    "sigmoid": "sigmoid", "tanh": "tanh",
    "topk": "topk", "sort": "sort", "kthvalue": "kthvalue", "mode": "mode",
    "median": "median", "nanmedian": "nanmedian", "quantile": "quantile",
    "nanquantile": "nanquantile", "argsort": "argsort", "msort": "msort",
    "t": "t", "transpose": "transpose",
}

# Ops that write into an argument: a value read before them may differ after them.
_INPLACE_FUNCTIONS = {operator.setitem, operator.iadd, operator.isub, operator.imul,
                      operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow,
                      operator.iand, operator.ior, operator.ixor, operator.ilshift,
                      operator.irshift, operator.imatmul}

# Ops whose result may share memory with their first argument.
VIEW_METHODS = {"t", "transpose", "permute", "view", "reshape", "expand", "expand_as",
                "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "split",
                "chunk", "unbind", "as_strided", "detach", "contiguous", "view_as", "movedim",
                "swapaxes", "swapdims", "__getitem__", "T", "mT", "H", "mH", "diagonal",
                "real", "imag", "reshape_as", "unfold", "tensor_split", "type_as", "to",
                "float", "data", "requires_grad_"}


def target_in(node: Node, table) -> bool:
    """Whether ``node``'s target is in ``table`` (a set or dict); False for an unhashable one."""
    try:
        return node.target in table
    except TypeError:  # an unhashable target
        return False


def canon(node: Node) -> str | None:
    """Canonical name of the operation ``node`` performs, or None if not one we know."""
    if node.op == "call_function":
        try:
            name = _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            return None
        if name is None and node.target is getattr and len(node.args) == 2 \
                and node.args[1] in ("T", "mT"):
            return "t"
        if name is None and isinstance(node.target, (torch._ops.OpOverload,
                                                     torch._ops.OpOverloadPacket)):
            packet = getattr(node.target, "overloadpacket", node.target)
            return _NAMED_OPS.get(packet._qualified_op_name)
        return name
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def bind(node: Node, name: str | None = None) -> dict | None:
    """Arguments of ``node`` by parameter name (defaults filled in), None if they do not fit."""
    name = name or canon(node)
    if name is None or name not in SIGNATURES:
        return None
    params, defaults = SIGNATURES[name]
    if node.op == "call_function" and node.target is getattr:  # x.T / x.mT
        return {"input": node.args[0]}
    out = dict(defaults)
    if len(node.args) > len(params):
        return None
    for p, a in zip(params, node.args):
        out[p] = a
    for k, v in node.kwargs.items():
        if k not in out and k not in params:
            return None
        out[k] = v
    if any(p not in out for p in params):
        return None
    return out


def op_name(n: Node) -> str:
    """``view``, ``expand``, ...: a method's name, a function's, or an ATen overload's op (the
    spelling, where ``canon`` names the operation only for the ops Kwker replaces)."""
    if n.op == "call_method":
        return n.target
    if isinstance(n.target, torch._ops.OpOverload):
        return n.target._opname
    return getattr(n.target, "__name__", "")


def is_inplace(node: Node) -> bool:
    """Whether ``node`` may write into one of its arguments."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.kwargs.get("inplace") is True or "out" in node.kwargs:
        return True
    t = node.target
    if node.op == "call_method":
        return t.endswith("_") and not t.startswith("_") or t in ("__setitem__", "__iadd__",
                                                                    "__isub__", "__imul__")
    try:
        if t in _INPLACE_FUNCTIONS:
            return True
    except TypeError:
        return False
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.is_mutable
    name = getattr(t, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def written_args(u: Node) -> list:
    """The nodes the in-place op ``u`` writes into: its ``out=`` tensors, a mutable ATen
    schema's written arguments, else (an in-place method, ``operator.iadd``, ``setitem``,
    ``inplace=True``) its first argument."""
    out = u.kwargs.get("out")
    if out is not None:
        return [o for o in (out if isinstance(out, (tuple, list)) else (out,))
                if isinstance(o, Node)]
    if isinstance(u.target, torch._ops.OpOverload):
        args = u.target._schema.arguments
        written = [a for a, spec in zip(u.args, args)
                   if spec.alias_info is not None and spec.alias_info.is_write]
        written += [u.kwargs[spec.name] for spec in args if spec.name in u.kwargs and
                    spec.alias_info is not None and spec.alias_info.is_write]
        return [a for a in written if isinstance(a, Node)]
    return [u.args[0]] if u.args and isinstance(u.args[0], Node) else []


def is_view(node: Node) -> bool:
    """Whether ``node``'s result may alias its first argument."""
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    if node.op == "call_function":
        if node.target is getattr or node.target is operator.getitem:
            return True
        if isinstance(node.target, torch._ops.OpOverload):
            schema = node.target._schema
            return not schema.is_mutable and any(r.alias_info is not None
                                                 for r in schema.returns)
        name = getattr(node.target, "__name__", "")
        return name in VIEW_METHODS
    return False
