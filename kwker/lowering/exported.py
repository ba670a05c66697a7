"""A ``torch.export`` program <-> plain data a package stores, and back to a graph to lower.

``describe(ep)`` turns an exported program into a JSON-able document (its nodes with ATen ops by
qualified name, argument slots and constants, every node's metadata, the user inputs with the
ranges of their dynamic sizes, the output structure) and the constant tensors. ``rebuild(doc,
tensors)`` makes an FX graph of it again, with the parameters as constants and ``Sym`` for the
symbolic sizes, which ``partition.lower_graph`` lowers exactly as it lowers a dynamo graph.
Package time lowers the rebuilt graph too, so packaging and loading run the same code on the
same data.

Only data is read back: targets resolve to ATen overloads and ``operator``/``math`` functions by
name, and nothing is unpickled, so a package cannot name arbitrary code to run.

torchao's weight-only quantised weights are stored as their parts (values, scales, zero points)
and read back as ``LowbitTensor``s, their uses rewritten into linears of them
(``lowbit_export``): a package of a quantised model loads without torchao.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Graph, Node

from ..kernels._call import contiguous_strides
from ..kernels.linear_lowbit import LowbitTensor, is_quantized, lowbit_weight
from .lowbit_export import LowbitExportError, desugar
from .shapes import Sym, TensorMeta

FORMAT = 1


class ExportError(ValueError):
    """What a package cannot hold, or a document this Kwker cannot rebuild; says which node."""


# --------------------------------------------------------------------------- values
def _size(s):
    """A size from export's fake values: an int, or ``Sym`` for a symbolic one."""
    if isinstance(s, torch.SymInt):
        known = s.node.maybe_as_int()
        if known is not None:
            return known
        expr = s.node.expr
        if expr.is_Symbol:
            return Sym.named(str(expr))
        if expr.is_Mul and all(a.is_Symbol or a.is_Integer for a in expr.args):
            coeff, names = 1, []
            for a in expr.args:
                if a.is_Integer:
                    coeff *= int(a)
                else:
                    names.append(str(a))
            return Sym(coeff, tuple(names))
        return Sym(text=str(expr))
    return int(s)


def _meta_of(v):
    if isinstance(v, torch.Tensor):
        return TensorMeta(tuple(_size(s) for s in v.shape), tuple(_size(s) for s in v.stride()),
                          v.dtype, v.device.type, False)
    if isinstance(v, (tuple, list)):
        return tuple(_meta_of(x) for x in v)
    if isinstance(v, torch.SymInt):
        return _size(v)
    if isinstance(v, (int, float, bool, type(None))):
        return v
    return None


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ExportError(f"unknown dtype {name!r}")
    return d


def encode_meta(m):
    if isinstance(m, TensorMeta):
        return {"tensor": {"shape": [_enc_size(s) for s in m.shape],
                           "stride": [_enc_size(s) for s in m.stride],
                           "dtype": dtype_name(m.dtype), "device": m.device}}
    if isinstance(m, tuple):
        return {"tuple": [encode_meta(x) for x in m]}
    if isinstance(m, Sym):
        return m.to_json()
    if isinstance(m, float) and not math.isfinite(m):
        return {"float": repr(m)}
    return m


def decode_meta(d):
    if isinstance(d, dict):
        if "tensor" in d:
            t = d["tensor"]
            return TensorMeta(tuple(_dec_size(s) for s in t["shape"]),
                              tuple(_dec_size(s) for s in t["stride"]),
                              dtype_of(t["dtype"]), str(t["device"]), False)
        if "tuple" in d:
            return tuple(decode_meta(x) for x in d["tuple"])
        if "float" in d:
            return float(d["float"])
        return Sym.from_json(d)
    return d


def _enc_size(s):
    return s.to_json() if isinstance(s, Sym) else int(s)


def _dec_size(s):
    return Sym.from_json(s) if isinstance(s, dict) else int(s)


_SCALARS = (bool, int, str, type(None))
_ENUMS = {"memory_format": (torch.memory_format, torch), "layout": (torch.layout, torch)}


def _encode_arg(a, where: str):
    if isinstance(a, Node):
        return {"node": a.name}
    if isinstance(a, _SCALARS):
        return a
    if isinstance(a, float):
        return a if math.isfinite(a) else {"float": repr(a)}
    if isinstance(a, tuple):
        return {"tuple": [_encode_arg(x, where) for x in a]}
    if isinstance(a, list):
        return [_encode_arg(x, where) for x in a]
    if isinstance(a, torch.dtype):
        return {"dtype": dtype_name(a)}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    for key, (kind, _) in _ENUMS.items():
        if isinstance(a, kind):
            return {key: str(a).removeprefix("torch.")}
    raise ExportError(f"{where}: an argument of type {type(a).__name__} cannot be packaged")


def _decode_arg(d, nodes: dict):
    if isinstance(d, list):
        return [_decode_arg(x, nodes) for x in d]
    if not isinstance(d, dict):
        return d
    if "node" in d:
        return nodes[d["node"]]
    if "tuple" in d:
        return tuple(_decode_arg(x, nodes) for x in d["tuple"])
    if "float" in d:
        return float(d["float"])
    if "dtype" in d:
        return dtype_of(d["dtype"])
    if "device" in d:
        return torch.device(d["device"])
    for key, (kind, mod) in _ENUMS.items():
        if key in d:
            v = getattr(mod, d[key], None)
            if not isinstance(v, kind):
                raise ExportError(f"unknown {key} {d[key]!r}")
            return v
    raise ExportError(f"unknown argument encoding {sorted(d)}")


# --------------------------------------------------------------------------- targets
_MODULES = {"operator": operator, "math": math}


def _encode_target(t, where: str) -> str:
    if isinstance(t, torch._ops.OpOverload):
        if t.namespace != "aten":
            raise ExportError(f"{where}: {t.name()} is not an ATen op (custom and higher-order "
                              "ops cannot be packaged)")
        return f"{t._schema.name}.{t._overloadname}"
    mod = getattr(t, "__module__", None)
    name = getattr(t, "__name__", None)
    for key, module in _MODULES.items():
        if getattr(module, name or "", None) is t:
            return f"{key}.{name}"
    if mod == "torch" and name and name.startswith("sym_") and getattr(torch, name) is t:
        return f"torch.{name}"
    raise ExportError(f"{where}: the call {t!r} cannot be packaged (ATen ops, operator and "
                      "math functions can)")


def resolve_target(text: str):
    """The callable a stored target names; ExportError if this torch has no such op."""
    if "::" in text:
        qual, _, overload = text.rpartition(".")
        ns, _, op = qual.partition("::")
        try:
            return getattr(getattr(getattr(torch.ops, ns), op), overload)
        except (AttributeError, RuntimeError):
            raise ExportError(f"this torch ({torch.__version__}) has no op {text}") from None
    mod, _, name = text.partition(".")
    if mod == "torch" and name.startswith("sym_"):
        fn = getattr(torch, name, None)
    elif mod in _MODULES:
        fn = getattr(_MODULES[mod], name, None)
    else:
        fn = None
    if fn is None:
        raise ExportError(f"unknown function {text}")
    return fn


# --------------------------------------------------------------------------- structures
def _encode_tree(spec, where: str):
    if spec.is_leaf():
        return "leaf"
    t = spec.type
    children = [_encode_tree(c, where) for c in spec.children()]
    if t is tuple:
        return {"tuple": children}
    if t is list:
        return {"list": children}
    if t is dict:
        return {"dict": children, "keys": list(spec.context)}
    if t.__module__ == "torch.return_types" and getattr(torch.return_types, t.__name__,
                                                        None) is t:
        return {"return_type": t.__name__, "items": children}
    raise ExportError(f"{where}: a {t.__qualname__} cannot be packaged (tensors, tuples, lists, "
                      "dicts and torch.return_types can)")


def build_tree(d, leaves):
    """The output structure ``d`` filled from the iterator ``leaves``."""
    if d == "leaf":
        return next(leaves)
    if "tuple" in d:
        return tuple(build_tree(c, leaves) for c in d["tuple"])
    if "list" in d:
        return [build_tree(c, leaves) for c in d["list"]]
    if "dict" in d:
        return {k: build_tree(c, leaves) for k, c in zip(d["keys"], d["dict"])}
    kind = getattr(torch.return_types, d["return_type"])
    return kind(tuple(build_tree(c, leaves) for c in d["items"]))


def flatten_tree(d, value, out: list, where: str = "the inputs") -> list:
    """``value``'s leaves appended to ``out`` in ``d``'s order (``build_tree``'s inverse), or
    TypeError saying where ``value`` departs from the structure ``d`` (the path is worked out
    only then: a decode step's call flattens its cache every token)."""
    if not _flatten(d, value, out):
        _explain(d, value, where)
    return out


def _flatten(d, value, out: list) -> bool:
    if d == "leaf":
        out.append(value)
        return True
    if "dict" in d:
        keys = d["keys"]
        return isinstance(value, dict) and set(value) == set(keys) and \
            all(_flatten(c, value[k], out) for k, c in zip(keys, d["dict"]))
    children = d.get("tuple", d.get("list", d.get("items")))
    return isinstance(value, (tuple, list)) and len(value) == len(children) and \
        all(_flatten(c, v, out) for c, v in zip(children, value))


def _explain(d, value, where: str) -> None:
    """TypeError at the first place ``value`` departs from ``d``."""
    if d == "leaf":
        return
    if "dict" in d:
        if not isinstance(value, dict) or set(value) != set(d["keys"]):
            raise TypeError(f"{where} must be a dict with keys {d['keys']}, got "
                            f"{_shape_of(value)}")
        for k, c in zip(d["keys"], d["dict"]):
            _explain(c, value[k], f"{where}[{k!r}]")
        return
    children = d.get("tuple", d.get("list", d.get("items")))
    if not isinstance(value, (tuple, list)) or len(value) != len(children):
        raise TypeError(f"{where} must be a tuple or list of {len(children)}, got "
                        f"{_shape_of(value)}")
    for i, (c, v) in enumerate(zip(children, value)):
        _explain(c, v, f"{where}[{i}]")


def _shape_of(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    return f"a {type(value).__name__}"


def tree_is_flat_tuple(d) -> bool:
    return isinstance(d, dict) and "tuple" in d and all(c == "leaf" for c in d["tuple"])


# --------------------------------------------------------------------------- export -> doc
def _ranges(ep) -> dict:
    return {str(sym): [_bound(vr.lower, 0), _bound(vr.upper, None)]
            for sym, vr in ep.range_constraints.items()}


def _bound(v, unbounded):
    """A range end as an int, or ``unbounded`` for an infinite one (torch's ``int_oo``, which
    sympy calls finite, or sympy's ``oo``)."""
    return int(v) if v.is_Integer else unbounded


def describe(ep) -> tuple[dict, dict[str, torch.Tensor]]:
    """(document, constant tensors by name) of an exported program, or ExportError naming what
    cannot be packaged."""
    from torch.export.graph_signature import InputKind, OutputKind
    state_kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    sig = ep.graph_signature
    bad = [o for o in sig.output_specs if o.kind != OutputKind.USER_OUTPUT]
    if bad:
        raise ExportError(f"the program mutates {bad[0].target!r} ({bad[0].kind.name}); "
                          "packages are for inference on stateless programs")
    in_spec, in_tree = ep.call_spec.in_spec, None
    if in_spec is not None:
        args_spec, kwargs_spec = in_spec.children()
        if kwargs_spec.num_leaves:
            raise ExportError("export the program with positional inputs only (no kwargs)")
        in_tree = _encode_tree(args_spec, "the inputs")
    ranges = _ranges(ep)
    graph, placeholders = _without_subclass_parts(ep, state_kinds)
    inputs, consts, tensors = [], [], {}
    for spec in sig.input_specs:
        node = placeholders[spec.arg.name]
        name = node.name
        if spec.kind == InputKind.USER_INPUT:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ExportError(f"input {name!r} is a {type(val).__name__}: packaged "
                                  "programs take tensors (other inputs were fixed at export)")
            dims = []
            for s in val.shape:
                size = _size(s)
                if isinstance(size, Sym) and size.text is None and len(size.names) == 1 \
                        and size.coeff == 1:
                    lo, hi = ranges.get(size.names[0], (0, None))
                    dims.append({"sym": size.names[0], "min": lo, "max": hi})
                elif isinstance(size, Sym):
                    dims.append({"expr": repr(size)})
                else:
                    dims.append(size)
            inputs.append({"name": name, "dtype": dtype_name(val.dtype),
                           "device": val.device.type, "shape": dims})
        elif spec.kind in state_kinds:
            t = _state(ep, spec)
            if is_quantized(t):
                lowbit, parts = _lowbit_parts(name, t)
                tensors.update(parts)
                consts.append({"name": name, "target": spec.target, "lowbit": lowbit})
                continue
            tensors[name] = t.detach().contiguous()
            consts.append({"name": name, "target": spec.target})
        else:
            raise ExportError(f"input {name!r} of kind {spec.kind.name} cannot be packaged")
    state = {c["name"]: c["target"] for c in consts}
    nodes = []
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        written = _written_state(n, state)
        if written is not None:
            raise ExportError(f"the program mutates {written!r} (node {n.name}); packages are "
                              "for inference on stateless programs")
        if n.op != "call_function":
            raise ExportError(f"node {n.name} ({n.op}) cannot be packaged: only calls of ATen "
                              "ops (no submodules or control flow)")
        where = f"node {n.name}"
        nodes.append({"name": n.name, "target": _encode_target(n.target, where),
                      "args": _encode_arg(list(n.args), where),
                      "kwargs": {k: _encode_arg(v, where) for k, v in n.kwargs.items()},
                      "meta": encode_meta(_meta_of(n.meta.get("val")))})
    output = next(n for n in graph.nodes if n.op == "output")
    doc = {"format": FORMAT, "inputs": inputs, "constants": consts, "nodes": nodes,
           "output": _encode_arg(output.args[0], "the output"),
           "out_tree": _encode_tree(ep.call_spec.out_spec, "the output"),
           "in_tree": in_tree,
           "ranges": ranges}
    return doc, tensors


def _state(ep, spec):
    """The parameter, buffer or constant tensor an input spec names."""
    return (ep.state_dict if spec.target in ep.state_dict else ep.constants)[spec.target]


def _without_subclass_parts(ep, state_kinds: tuple) -> tuple[Graph, dict]:
    """(the program's graph, its placeholders by the signature's names); with torchao weights,
    a copy whose uses of them are linears (``state_kinds``: the input kinds of parameters,
    buffers and constants). The copy may rename a placeholder (``input``, a builtin's name,
    becomes ``input_1``): the document takes the copy's names."""
    graph = ep.graph_module.graph
    original = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    quantized = {spec.arg.name for spec in ep.graph_signature.input_specs
                 if spec.kind in state_kinds and is_quantized(_state(ep, spec))}
    if not quantized:
        return graph, original
    copy, copied = Graph(), {}
    copy.output(copy.graph_copy(graph, copied))
    placeholders = {name: copied[n] for name, n in original.items()}
    try:
        desugar(copy, {placeholders[name].name for name in quantized})
    except LowbitExportError as e:
        raise ExportError(str(e)) from None
    return copy, placeholders


def _lowbit_parts(name: str, t) -> tuple[dict, dict]:
    """(the constant's ``lowbit`` record, its part tensors by stored name)."""
    try:
        lw = lowbit_weight(t)
    except NotImplementedError as e:
        raise ExportError(f"constant {name!r}: {e}") from None
    parts = {"qdata": lw.qdata, "scale": lw.scale, "zero_point": lw.zero_point}
    stored = {k: f"{name}.{k}" for k, v in parts.items() if v is not None}
    record = {"group": lw.group, "bits": lw.bits, "dtype": dtype_name(lw.dtype),
              "format": lw.source, "parts": stored}
    tensors = {stored[k]: parts[k].detach().contiguous() for k in stored}
    q = lw.qdata
    if lw.bits == 4 and q.numel() and -8 <= int(q.min()) and int(q.max()) <= 7:
        # two values a byte in the file (torchao keeps one): unpacked again when read
        tensors[stored["qdata"]] = _nibbles(q)
        record["qdata"] = {"nibbles": list(q.shape)}
    return record, tensors


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], (N, K) -> uint8 (N, ceil(K / 2)): ``q + 8`` of even k in the low
    nibble, of odd k in the high one."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if u.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1))
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unnibble(p: torch.Tensor, shape: list) -> torch.Tensor:
    """``_nibbles``' inverse: the (N, K) int8 values."""
    q = torch.stack((p & 15, p >> 4), dim=2).reshape(p.shape[0], -1)[:, :shape[1]]
    return (q.to(torch.int8) - 8).contiguous()


def nibbled(doc: dict) -> dict[str, list]:
    """The stored tensors held two values a byte (``unnibble`` reads them), by stored name:
    their (N, K) shape once unpacked."""
    return {c["lowbit"]["parts"]["qdata"]: c["lowbit"]["qdata"]["nibbles"]
            for c in doc["constants"] if "nibbles" in c.get("lowbit", {}).get("qdata", {})}


def lowbit_parts(c: dict, tensors: dict) -> dict:
    """A quantised constant's parts (qdata, scale, zero_point), from the stored tensors as read
    (int4 values unpacked already: ``nibbled``)."""
    return {k: tensors[v] for k, v in c["lowbit"]["parts"].items()}


def stored_names(doc: dict) -> list[str]:
    """The names of the tensors a package stores for its constants, in order."""
    return [n for c in doc["constants"]
            for n in (c["lowbit"]["parts"].values() if "lowbit" in c else [c["name"]])]


def _constant(c: dict, tensors: dict) -> torch.Tensor:
    if "lowbit" not in c:
        return tensors[c["name"]]
    q = c["lowbit"]
    parts = lowbit_parts(c, tensors)
    return LowbitTensor(parts["qdata"], parts["scale"], parts.get("zero_point"), q["group"],
                        q["bits"], dtype_of(q["dtype"]))


def _written_state(n: Node, state: dict) -> str | None:
    """The parameter or buffer ``n`` writes in place (through views), if any."""
    t = n.target
    if not (isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable) or not n.args:
        return None
    src = n.args[0]
    while isinstance(src, Node) and src.op == "call_function" and src.args and \
            isinstance(src.target, torch._ops.OpOverload) and \
            any(r.alias_info is not None for r in src.target._schema.returns):
        src = src.args[0]
    if isinstance(src, Node) and src.op == "placeholder" and src.name in state:
        return state[src.name]
    return None


# --------------------------------------------------------------------------- doc -> graph
class Rebuilt:
    """What ``lower_graph`` and ``build_program`` need of a GraphModule: ``graph`` and the
    constants as attributes (``get_attr`` targets)."""

    def __init__(self, graph: Graph, constants: dict):
        self.graph = graph
        self.__dict__.update(constants)


def rebuild(doc: dict, tensors: dict[str, torch.Tensor]) -> tuple[Rebuilt, dict]:
    """(graph object, metadata by node) from ``describe``'s document and the constants."""
    if doc.get("format") != FORMAT:
        raise ExportError(f"graph format {doc.get('format')!r}; this Kwker reads {FORMAT}")
    graph = Graph()
    by_name: dict[str, Node] = {}
    metas: dict[Node, object] = {}
    for inp in doc["inputs"]:
        n = graph.placeholder(inp["name"])
        by_name[inp["name"]] = n
        shape = tuple(d if isinstance(d, int) else Sym.named(d["sym"]) if "sym" in d
                      else Sym(text=d["expr"]) for d in inp["shape"])
        metas[n] = TensorMeta(shape, contiguous_strides(shape), dtype_of(inp["dtype"]),
                              inp["device"], False)
    attrs = {}
    for c in doc["constants"]:
        name = c["name"]
        t = _constant(c, tensors)
        n = graph.get_attr(name)
        by_name[name], attrs[name] = n, t
        metas[n] = TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, False)
    for d in doc["nodes"]:
        target = resolve_target(d["target"])
        if target is torch.ops.aten._assert_tensor_metadata.default:
            continue   # export's check of a cast's input, which a fixed graph cannot fail; as a
            # second user of a norm's float32 product it kept the norm's kernel from matching
        n = graph.create_node("call_function", target, tuple(_decode_arg(d["args"], by_name)),
                              {k: _decode_arg(v, by_name) for k, v in d["kwargs"].items()},
                              name=d["name"])
        by_name[d["name"]] = n
        metas[n] = decode_meta(d["meta"])
    graph.output(_decode_arg(doc["output"], by_name))
    return Rebuilt(graph, attrs), metas
