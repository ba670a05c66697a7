"""Ops written out in elementwise ops: GELU (recognised by what it computes), RMSNorm,
SwiGLU's ``silu(gate) * up``, rotary embeddings and attention (``softmax(q @ k^T * c) @ v``,
recognised by their structure, after GELU in this file).

Model libraries spell GELU by hand: transformers' ``NewGELUActivation`` (GPT-2's "gelu_new") is
``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3))))``, ``FastGELUActivation``
factors it differently, others write ``x * 0.5 * (1 + erf(x / sqrt(2)))``. Rather than one
pattern per spelling, a *cone* is taken: the nodes above a candidate output that are elementwise
arithmetic on one tensor ``x`` and constants, used only inside the cone. The cone is evaluated in
float64 on a dense grid of x and compared with both GELU forms; if one agrees to 1e-9 the cone
is that GELU. Kwker's kernel then computes it in float32 with one rounding, closer to the
exact function than the op-by-op original (which rounds after each op in bf16).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch.fx import Node

_aten = torch.ops.aten
_FUNCS = {operator.mul, operator.add, operator.sub, operator.truediv, operator.pow,
          operator.neg, torch.mul, torch.add, torch.sub, torch.div, torch.pow, torch.tanh,
          torch.erf, torch.neg, torch.special.erf,
          # the same in ATen ops, as torch.export writes them (a package's graph)
          _aten.mul.Tensor, _aten.mul.Scalar, _aten.add.Tensor, _aten.add.Scalar,
          _aten.sub.Tensor, _aten.sub.Scalar, _aten.rsub.Scalar, _aten.div.Tensor,
          _aten.div.Scalar, _aten.pow.Tensor_Scalar, _aten.tanh.default, _aten.erf.default,
          _aten.neg.default}
_METHODS = {"mul", "add", "sub", "div", "pow", "tanh", "erf", "neg", "__mul__", "__add__",
            "__sub__", "__truediv__", "__pow__", "__rmul__", "__radd__", "__rsub__",
            "__rtruediv__", "__neg__"}
MAX_CONE = 16
_GRID = torch.linspace(-9.0, 9.0, 361, dtype=torch.float64)
_FORMS = {
    "tanh": 0.5 * _GRID * (1 + torch.tanh(math.sqrt(2 / math.pi) *
                                          (_GRID + 0.044715 * _GRID ** 3))),
    "none": 0.5 * _GRID * (1 + torch.erf(_GRID / math.sqrt(2))),
}


def _is(n, fns=(), methods=()) -> bool:
    """Whether ``n`` calls one of the functions ``fns`` or the methods ``methods``."""
    if not isinstance(n, Node):
        return False
    if n.op == "call_function":
        try:
            return n.target in fns
        except TypeError:
            return False
    return n.op == "call_method" and n.target in methods


def _arith(n) -> bool:
    return _is(n, _FUNCS, _METHODS)


def _cone(end: Node, stop: Node | None = None) -> tuple[Node, list] | None:
    """(the one tensor input, the cone's nodes in graph order) or None; ``stop`` is taken as
    the input even if it is arithmetic itself (GELU of ``x * 2``)."""
    cone, todo, leaves = {end}, [end], set()
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a in cone or a in leaves:
                continue
            if _arith(a) and a is not stop:
                cone.add(a)
                todo.append(a)
                if len(cone) > MAX_CONE:
                    return None
            else:
                leaves.add(a)
    if len(leaves) != 1 or len(cone) < 3:
        return None
    if any(u not in cone for n in cone if n is not end for u in n.users):
        return None  # an intermediate value is used elsewhere: it must be computed anyway
    order = {n: i for i, n in enumerate(end.graph.nodes)}
    return leaves.pop(), sorted(cone, key=order.__getitem__)


def _evaluate(x: Node, cone: list, grid: torch.Tensor) -> torch.Tensor | None:
    values = {x: grid}

    def arg(a):
        if isinstance(a, Node):
            return values[a]
        if isinstance(a, (int, float)):
            return a
        raise TypeError("non-scalar constant")

    try:
        for n in cone:
            args = [arg(a) for a in n.args]
            kwargs = {k: arg(v) for k, v in n.kwargs.items()}
            if n.op == "call_function":
                values[n] = n.target(*args, **kwargs)
            else:
                values[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    except (TypeError, RuntimeError, KeyError):
        return None
    out = values[cone[-1]]
    return out if isinstance(out, torch.Tensor) and out.shape == grid.shape else None


def gelu_cone(end: Node) -> tuple[Node, list, str] | None:
    """(x, the nodes to replace, "tanh" | "none") if ``end`` computes GELU of ``x``."""
    if not _arith(end):
        return None
    found = _cone(end)
    if found is None:
        return None
    # the input is the widest cone's leaf, or an arithmetic node used twice or more inside it
    # (every spelling reads x at least twice: x * (1 + f(x)))
    inputs = [found[0]] + [n for n in reversed(found[1][:-1])
                           if sum(u in found[1] for u in n.users) >= 2]
    for stop in inputs:
        cut = found if stop is found[0] else _cone(end, stop)
        if cut is None or cut[0] is not stop:
            continue
        out = _evaluate(stop, cut[1], _GRID)
        if out is None:
            continue
        for form, ref in _FORMS.items():
            if torch.allclose(out, ref, rtol=1e-9, atol=1e-12):
                return stop, cut[1], form
    return None


def find_gelus(nodes: list) -> dict:
    """{end node: (x, cone, form)} for every hand-written GELU among ``nodes`` (cones are
    searched from the last node up, so a node inside a found cone starts no other)."""
    found, inside = {}, set()
    for n in reversed(nodes):
        if n in inside or n.op not in ("call_function", "call_method"):
            continue
        g = gelu_cone(n)
        if g is not None:
            found[n] = g
            inside.update(g[1])
    return found


# ------------------------------------------------------------------------------- RMSNorm
def _other(n: Node, x):
    """The operand of the binary node ``n`` that is not ``x`` (None if ``x`` is not one)."""
    a = list(n.args[:2])
    if len(a) != 2 or n.kwargs or x not in a:
        return None
    return a[1] if a[0] is x else a[0]


def _only_user(n: Node):
    return next(iter(n.users)) if len(n.users) == 1 else None


# each with its ATen op, as torch.export writes them (a package's graph)
_MUL = ((operator.mul, torch.mul, _aten.mul.Tensor), ("mul", "__mul__", "__rmul__"))
_ADD = ((operator.add, torch.add, _aten.add.Tensor), ("add", "__add__", "__radd__"))
_CASTS = ((_aten.to.dtype, _aten._to_copy.default), ("to",))


def _one_plus(n) -> tuple | None:
    """(the parameter, [its cast if any, the add]) if ``n`` is ``1 + w`` or ``1 + w.float()``
    of a parameter or attribute ``w`` (Gemma's norm weight), each used once, else None."""
    if not isinstance(n, Node) or not _is(n, *_ADD) or len(n.users) != 1 or n.kwargs or \
            len(n.args) != 2:
        return None
    ones = [a for a in n.args if type(a) in (int, float) and a == 1]
    w = n.args[0] if n.args[1] in ones else n.args[1] if n.args[0] in ones else None
    if not isinstance(w, Node):
        return None
    if w.op in ("placeholder", "get_attr"):
        return w, [n]   # (the matcher checks that w is float32 then: the add is)
    src = cast_of(w)
    to_f32 = len(w.args) == 1 or w.args[1:] == (torch.float32,)   # .float() or .to(float32)
    if isinstance(src, Node) and src.op in ("placeholder", "get_attr") and len(w.users) == 1 \
            and to_f32 and not w.kwargs:
        return src, [w, n]
    return None


def rms_norm_at(r: Node) -> tuple | None:
    """An RMSNorm written out around the ``rsqrt`` node ``r``: (x, the weight node or None,
    eps, covered nodes in graph order, the output node, the weight's offset, the norm kind),
    or None. Three forms, as transformers writes them: Llama/Mistral/T5's ``h = x.to(float32);
    h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)``, then ``.to(x.dtype)`` and ``weight *
    ...`` ("rms_hf": rounded before the weight); OLMo 2's ``(weight * ...).to(x.dtype)`` ("rms":
    one rounding, after the weight); and Gemma's ``... * (1.0 + weight.float())`` then
    ``.type_as(x)`` ("rms" with the weight offset by 1)."""
    if not _is(r, (torch.rsqrt, _aten.rsqrt.default), ("rsqrt",)) or len(r.args) != 1:
        return None
    a = r.args[0]
    if not _is(a, *_ADD) or len(a.users) != 1:
        return None
    v = next((x for x in a.args[:2] if _is(x, (torch.mean, _aten.mean.dim), ("mean",))),
             None)
    eps = _other(a, v) if v is not None else None
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or len(v.users) != 1:
        return None
    dim = v.args[1] if len(v.args) > 1 else v.kwargs.get("dim")
    keepdim = v.args[2] if len(v.args) > 2 else v.kwargs.get("keepdim")
    if dim not in (-1, [-1], (-1,)) or keepdim is not True:
        return None
    p = v.args[0]
    if _is(p, (torch.pow, _aten.pow.Tensor_Scalar), ("pow", "__pow__")) and \
            len(p.args) == 2 and p.args[1] == 2 or \
            _is(p, *_MUL) and len(p.args) == 2 and p.args[0] is p.args[1]:
        h = p.args[0]
    else:
        return None
    y = _only_user(r)
    if y is None or len(p.users) != 1 or not _is(y, *_MUL) or _other(y, r) is not h:
        return None
    covers, x = [p, v, a, r, y], h
    if _is(h, _CASTS[0], ("to", "float")) and len(h.args) in (1, 2) and not h.kwargs and \
            set(h.users) == {p, y}:
        covers.insert(0, h)
        x = h.args[0]
    # else the norm reads h as it is (torch.export drops a cast to the dtype x has, and x is
    # the residual stream, read again after the norm)
    out, weight = y, None
    cast = _only_user(out)
    if cast is not None and _is(cast, *_CASTS) and len(cast.args) == 2 and not cast.kwargs:
        covers.append(cast)
        out = cast
    m = _only_user(out)
    if m is not None and _is(m, *_MUL):
        w = _other(m, out)
        if isinstance(w, Node) and w.op in ("placeholder", "get_attr"):
            covers.append(m)
            last = _only_user(m)
            if out is y and last is not None and cast_of(last) is m:
                return x, w, float(eps), covers + [last], last, 0.0, "rms"   # OLMo 2's
            out, weight = m, w
        elif out is y and (gemma := _one_plus(w)) is not None:
            weight, extra = gemma
            covers += extra + [m]
            out = m
            last = _only_user(m)
            if last is not None and cast_of(last) is m:
                covers.append(last)
                out = last
            order = {n: i for i, n in enumerate(r.graph.nodes)}
            return x, weight, float(eps), sorted(covers, key=order.__getitem__), out, 1.0, "rms"
    return x, weight, float(eps), covers, out, 0.0, "rms_hf"


# ------------------------------------------------------------------------------- SiLU * y
_SILU = (torch.nn.functional.silu, torch.ops.aten.silu.default)


def silu_mul_at(n: Node) -> tuple | None:
    """``silu(g) * u`` ending at the product ``n`` (SwiGLU's gate, Llama's MLP), the SiLU used
    only there: (g, u, covered nodes), or None."""
    if not _is(n, *_MUL) or len(n.args) != 2 or n.kwargs:
        return None
    for s, u in (n.args, n.args[::-1]):
        if _is(s, _SILU, ("silu",)) and len(s.users) == 1 and isinstance(u, Node) and \
                len(s.args) == 1 and not s.kwargs.get("inplace", False):
            return s.args[0], u, [s, n]
    return None


# ------------------------------------------------------------------- rotary embedding
_NEG = ((operator.neg, torch.neg, _aten.neg.default), ("neg", "__neg__"))
_CAT = ((torch.cat, torch.concat, _aten.cat.default), ())
_END = 1 << 62  # an open slice end, as torch.export writes it (sys.maxsize)


def _half(n) -> tuple | None:
    """(x, "lo" | "hi", h, dim) if ``n`` is ``x[..., :h]`` / ``x[..., h:]`` (a getitem: dim
    -1, or ATen's slice of ``dim``) used once, else None."""
    if not isinstance(n, Node) or len(n.users) != 1:
        return None
    if n.op == "call_function" and n.target is operator.getitem and len(n.args) == 2:
        x, idx = n.args
        if not (isinstance(idx, tuple) and len(idx) == 2 and idx[0] is Ellipsis and
                isinstance(idx[1], slice) and idx[1].step in (None, 1)):
            return None
        dim, lo, hi = -1, idx[1].start, idx[1].stop
    elif _is(n, (_aten.slice.Tensor,)) and 3 <= len(n.args) <= 5 and not n.kwargs:
        x, dim, lo, hi = (list(n.args) + [None])[:4]
        if type(dim) is not int or (n.args[4:] or [1])[0] != 1:
            return None
        hi = None if isinstance(hi, int) and hi >= _END else hi
    else:
        return None
    lo = None if type(lo) is int and lo == 0 else lo
    if not isinstance(x, Node):
        return None
    if lo is None and type(hi) is int and hi > 0:
        return x, "lo", hi, dim
    if hi is None and type(lo) is int and lo > 0:
        return x, "hi", lo, dim
    return None


def _rotated(cat: Node) -> tuple | None:
    """(x, h, its nodes, the dims it slices and joins) if ``cat`` is ``rotate_half(x)``, that
    is ``cat((-x[..., h:], x[..., :h]), -1)`` (the caller checks the dims are x's last)."""
    if not _is(cat, *_CAT) or len(cat.users) != 1:
        return None
    parts = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or type(dim) is not int:
        return None
    neg, lo = parts
    if not _is(neg, *_NEG) or len(neg.args) != 1 or len(neg.users) != 1:
        return None
    a, b = _half(neg.args[0]), _half(lo)
    if a is None or b is None or a[0] is not b[0] or (a[1], b[1]) != ("hi", "lo") or \
            a[2] != b[2]:
        return None
    return a[0], a[2], [neg.args[0], lo, neg, cat], {dim, a[3], b[3]}


def rope_at(n: Node) -> tuple | None:
    """``x * c + rotate_half(x) * s`` ending at the sum ``n`` (transformers'
    ``apply_rotary_pos_emb`` for q or k): (x, c, s, h, the dims rotate_half slices and joins,
    covered nodes in graph order), or None."""
    if not _is(n, *_ADD) or len(n.args) != 2 or n.kwargs:
        return None
    for m1, m2 in (n.args, n.args[::-1]):
        if not (_is(m1, *_MUL) and _is(m2, *_MUL)) or len(m1.users) != 1 or \
                len(m2.users) != 1 or len(m2.args) != 2 or m2.kwargs:
            continue
        for cat, s in (m2.args, m2.args[::-1]):
            rot = _rotated(cat) if isinstance(cat, Node) else None
            if rot is None or not isinstance(s, Node):
                continue
            x, h, inner, dims = rot
            c = _other(m1, x)
            if not isinstance(c, Node):
                continue
            order = {node: i for i, node in enumerate(n.graph.nodes)}
            covers = sorted(inner + [m1, m2, n], key=order.__getitem__)
            return x, c, s, h, dims, covers
    return None


# ---------------------------------------------------------------- attention written out
_MATMUL = ((operator.matmul, torch.matmul, torch.bmm, _aten.matmul.default, _aten.bmm.default),
           ("matmul", "__matmul__", "bmm"))
_DIV = ((operator.truediv, torch.div, _aten.div.Tensor), ("div", "__truediv__"))
_SOFTMAX = ((F.softmax, torch.softmax, _aten.softmax.int, _aten._softmax.default), ("softmax",))
_FILL = ((torch.masked_fill, _aten.masked_fill.Scalar), ("masked_fill",))
_DROPOUT = ((F.dropout, torch.dropout, _aten.dropout.default), ("dropout",))
_TRANSPOSE = ((torch.transpose, _aten.transpose.int), ("transpose",))


def _number(c) -> bool:
    return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c != 0


def is_softmax(n) -> bool:
    return _is(n, *_SOFTMAX)


def cast_of(n):
    """The input of a dtype cast ``n`` (``.to(dtype)``, ``.type(dtype)``, ``.float()``,
    ``.type_as(t)``), else None."""
    if not isinstance(n, Node) or n.kwargs:
        return None
    if _is(n, (*_CASTS[0], _aten.type_as.default), ("to", "type_as", "type")) and \
            len(n.args) == 2 or \
            _is(n, (), ("float",)) and len(n.args) == 1:
        return n.args[0]
    return None


def _softmax_dim(n: Node):
    """(the softmax's dim, its dtype argument) of the softmax node ``n``."""
    a, kw = n.args, n.kwargs
    dim = a[1] if len(a) > 1 else kw.get("dim")
    if n.op == "call_function" and n.target is _aten._softmax.default:
        return dim, None if not a[2] else torch.float32
    if n.op == "call_function" and n.target is F.softmax:   # (input, dim, _stacklevel, dtype)
        return dim, a[3] if len(a) > 3 else kw.get("dtype")
    return dim, a[2] if len(a) > 2 else kw.get("dtype")


def attention_at(n: Node, rank) -> tuple | None:
    """Attention written out, ending at the product ``n`` (nanoGPT's, transformers' eager
    attention, hand-written blocks): ``softmax(q @ k.transpose(-2, -1) * c [+ mask |
    .masked_fill(cond, value)], -1) [dropout in eval] @ v``, with ``/ c`` for ``* c``, casts
    around the softmax (``.float()``, ``.to(dtype)``, ``.type_as(t)``) and every intermediate
    used only inside the pattern: (q, k, v, mask or None, mask
    kind "float" | "fill" | None, the fill value, scale, softmax's dtype argument, covered
    nodes in graph order), or None. ``rank(node)`` gives a tensor node's rank (None if
    unknown)."""
    if not _is(n, *_MATMUL) or len(n.args) != 2 or n.kwargs:
        return None
    p, v = n.args
    covers = [n]

    def single(x) -> bool:
        return isinstance(x, Node) and len(x.users) == 1

    if single(p) and _is(p, *_DROPOUT):   # identity in eval: F.dropout(x, p, False)
        a, kw = p.args, p.kwargs
        train = a[2] if len(a) > 2 else kw.get("training", True)
        if train is not False and (a[1] if len(a) > 1 else kw.get("p", 0.5)) != 0:
            return None
        covers.append(p)
        p = a[0]
    while single(p) and cast_of(p) is not None:
        covers.append(p)
        p = cast_of(p)
    if not (single(p) and _is(p, *_SOFTMAX)):
        return None
    dim, dtype = _softmax_dim(p)
    r = rank(p)
    if r is None or not isinstance(dim, int) or dim % r != r - 1:
        return None
    covers.append(p)
    x = p.args[0]
    while isinstance(x, Node) and cast_of(x) is not None:   # T5's scores.float()
        covers.append(x)
        x = cast_of(x)
    mask, kind, fill = None, None, -math.inf
    if isinstance(x, Node) and _is(x, *_FILL) and len(x.args) == 3 and not x.kwargs and \
            isinstance(x.args[1], Node) and isinstance(x.args[2], (int, float)) and \
            not isinstance(x.args[2], bool) and (math.isfinite(x.args[2]) or x.args[2] < 0):
        mask, kind, fill = x.args[1], "fill", float(x.args[2])
        covers.append(x)
        x = x.args[0]
    elif isinstance(x, Node) and _is(x, *_ADD) and len(x.args) == 2 and not x.kwargs:
        for s_, m_ in (x.args, x.args[::-1]):
            if isinstance(m_, Node) and _scores(s_, rank) is not None:
                mask, kind = m_, "float"
                covers.append(x)
                x = s_
                break
        else:
            return None
    found = _scores(x, rank)
    if found is None:
        return None
    q, k, scale, inner = found
    covers += inner
    inside = set(covers)
    if any(not set(c.users) <= inside for c in covers if c is not n):
        return None   # an intermediate read elsewhere (the weights returned, say)
    order = {node: i for i, node in enumerate(n.graph.nodes)}
    return q, k, v, mask, kind, fill, scale, dtype, sorted(covers, key=order.__getitem__)


def _scores(x, rank) -> tuple | None:
    """(q, k, scale, nodes) if ``x`` is ``q @ k.transpose(-2, -1)`` times / over constants,
    each node used once (the transpose may have other users: it is covered only if not)."""
    scale, inner = 1.0, []
    while isinstance(x, Node) and len(x.users) == 1 and len(x.args) == 2 and not x.kwargs:
        a, b = x.args
        if _is(x, *_MUL) and (_number(a) or _number(b)):
            scale, operand = (scale * a, b) if _number(a) else (scale * b, a)
        elif _is(x, *_DIV) and _number(b):
            scale, operand = scale / b, a
        else:
            break
        inner.append(x)
        x = operand
    if not (isinstance(x, Node) and len(x.users) == 1 and _is(x, *_MATMUL) and
            len(x.args) == 2 and not x.kwargs):
        return None
    q, kt = x.args
    r = rank(kt)
    if not isinstance(kt, Node) or r is None or r < 3 or not _is(kt, *_TRANSPOSE) or \
            len(kt.args) != 3 or kt.kwargs or \
            {d % r for d in kt.args[1:] if isinstance(d, int)} != {r - 2, r - 1}:
        return None
    inner.append(x)
    if len(kt.users) == 1:
        inner.append(kt)
    return q, kt.args[0], scale, inner
