"""FX nodes -> the Kwker kernels that can replace them (structure only, no sizes).

A ``Match`` names a kernel kind, the nodes it replaces and its inputs. Matching looks only at
what holds for every size dynamo may pass: the operations, single-use chains, which tensors are
parameters (compile-time constants), dtypes and ranks. Whether concrete sizes fit a kernel is
decided when the kernel is built (``build.py``), or, under Inductor, inside the custom op.

Fused chains: a GEMM with a constant weight absorbs a following activation (ReLU, SiLU,
sigmoid, tanh, GELU) and then a residual ``add``; a GEMM whose only user is ``topk`` along the
last axis becomes one kernel that never writes the score matrix; attention written out
(``softmax(q @ k^T * c + mask) @ v``) becomes the attention kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from ..kernels._call import KERNEL_DTYPES  # the compute kernels' (sorting.py: more)
from . import sorting as S
from .autocast import cast_source
from .composite import (
    attention_at,
    cast_of,
    find_gelus,
    is_softmax,
    rms_norm_at,
    rope_at,
    silu_mul_at,
)
from .gqa import repeated_kv
from .grouped import grouped_mm_at
from .masks import every_key_visible
from .ops import bind, canon, is_inplace, op_name
from .shapes import TensorMeta

# activations a GEMM with a weight takes into its epilogue (by their canonical names)
ACTIVATIONS = ("relu", "silu", "sigmoid", "tanh", "gelu")


@dataclass
class Match:
    kind: str   # linear | matmul | gelu | sdpa | linear_topk | layer_norm | silu_mul | rope
    #             | grouped_mm | sorting
    output: Node              # the node whose value the kernel produces
    covers: list              # every node the kernel replaces, in graph order
    inputs: dict              # name -> Node (runtime tensor) or constant
    params: dict = field(default_factory=dict)
    fallback: list = field(default_factory=list)  # smaller matches to try if this one fails

    @property
    def name(self) -> str:
        p = self.params
        if self.kind == "linear":
            return "linear" + ("" if p["epilogue"] == "none" else "_" + p["epilogue"]) + \
                ("_residual" if self.inputs.get("residual") is not None else "")
        if self.kind == "sorting":
            return p["op"]
        if self.kind == "layer_norm" and p.get("norm", "layer") != "layer":
            return "rms_norm"
        return self.kind


def _meta(metas: dict, n) -> TensorMeta | None:
    m = metas.get(n) if isinstance(n, Node) else None
    return m if isinstance(m, TensorMeta) else None


def _fits(metas, *nodes, rank=None, dtype=None) -> bool:
    """CPU tensors of one kernel dtype (``dtype`` if given), of a rank in ``rank``."""
    for n in nodes:
        m = _meta(metas, n)
        if m is None or m.dtype not in KERNEL_DTYPES or m.device != "cpu":
            return False
        if dtype is not None and m.dtype != dtype:
            return False
        if rank is not None and len(m.shape) not in rank:
            return False
    return True


def _dtype(metas, n) -> torch.dtype | None:
    m = _meta(metas, n)
    return m.dtype if m is not None else None


def _through_cast(n, consts, metas=None) -> tuple:
    """(n, []) or, for an autocast cast of a constant (or, given ``metas``, of a transposed
    constant), (what it casts, [the cast]): the factory rounds the constant itself, once."""
    src = cast_source(n)
    if src is not None and (src in consts or metas is not None and
                            _transposed_const(src, metas, consts) is not None):
        return src, [n]
    return n, []


def _flattened(metas, x: Node, n: Node) -> tuple[Node, Node, list] | None:
    """(X, V, [x if covered]) when a 2-D product ``n`` is ``X.view(-1, K) @ W`` viewed back as
    ``V = n.view(*X.shape[:-1], N)`` (``torch.addmm(b, x.view(-1, k), w).view(...)``): then it
    is the linear of X, and an epilogue after V fuses. Known sizes only."""
    src = x.args[0] if x.op in ("call_function", "call_method") and x.args else None
    out = _sole_user(n)
    if not isinstance(src, Node) or out is None or op_name(x) not in ("view", "reshape") or \
            op_name(out) not in ("view", "reshape"):
        return None
    ms, mx, mn, mo = (_meta(metas, v) for v in (src, x, n, out))
    if None in (ms, mx, mn, mo) or not _fits(metas, src, rank=tuple(range(3, 9))):
        return None
    shapes = (ms.shape, mx.shape, mn.shape, mo.shape)
    if any(not isinstance(d, int) for sh in shapes for d in sh):
        return None
    lead = ms.shape[:-1]
    if mx.shape != (math.prod(lead), ms.shape[-1]) or mo.shape != (*lead, mn.shape[-1]):
        return None
    return src, out, [x] if _sole_user(x) is n else []


def _sole_user(n: Node) -> Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _transposed_const(y: Node, metas, consts) -> Node | None:
    """The constant 2-D W if ``y`` is a transpose view of it (W.t(), W.T, W.transpose(0, 1))."""
    kind = canon(y)
    if op_name(y) == "permute" and tuple(y.args[1:]) in ((1, 0), ([1, 0],)) or kind == "t":
        w = y.args[0]
    elif kind == "transpose":
        b = bind(y)
        if b is None or {b["dim0"], b["dim1"]} not in ({0, 1}, {-1, -2}, {0, -1}, {-2, 1}):
            return None
        w = b["input"]
    else:
        return None
    return w if w in consts and _fits(metas, w, rank=(2,)) else None


class Matcher:
    def __init__(self, nodes: list, metas: dict, consts: set, sorting: bool):
        self.nodes, self.metas, self.consts, self.sorting = nodes, metas, consts, sorting
        self.order = {n: i for i, n in enumerate(nodes)}
        self.writes = [self.order[n] for n in nodes if is_inplace(n)]
        # GELUs written out in elementwise ops (transformers' gelu_new and friends)
        self.gelus = find_gelus(nodes)
        self.gelu_of = {x: end for end, (x, _, _) in self.gelus.items()}
        # attention written out: matched at its last product, its first left to that match
        self.attention = {}
        for n in nodes:
            m = self.written_attention(n)
            if m is not None:
                self.attention[n] = m
        self.in_attention = {c for m in self.attention.values() for c in m.covers
                             if c is not m.output}

    def run(self) -> list[Match]:
        claimed: set = set()
        found = []

        def accept(m: Match) -> None:
            if claimed.intersection(m.covers) or self._spans_write(m):
                for f in m.fallback:
                    accept(f)
                return
            claimed.update(m.covers)
            found.append(m)

        for n in self.nodes:
            if n in claimed or n.op not in ("call_function", "call_method"):
                continue
            m = self.match(n)
            if m is not None:
                accept(m)
        return found

    def _spans_write(self, m: Match) -> bool:
        """A fused kernel reads its inputs where its last node was: nothing may write between."""
        lo = min(self.order[c] for c in m.covers)
        hi = self.order[m.output]
        return any(lo <= w < hi for w in self.writes)

    def match(self, n: Node) -> Match | None:
        if n in self.attention:
            return self.attention[n]
        if n in self.in_attention:
            return None
        kind = canon(n)
        if kind in ("linear", "matmul", "mm", "addmm"):
            m = self.gemm_const(n, kind)
            if m is not None:
                return m
        if kind in ("matmul", "mm", "bmm"):
            return self.gemm(n, kind)
        if n in self.gelus:
            x, cone, form = self.gelus[n]
            if _fits(self.metas, x) and _dtype(self.metas, n) == _dtype(self.metas, x):
                return Match("gelu", n, list(cone), {"x": x}, {"approximate": form})
        if kind == "gelu":
            b = bind(n)
            if b and b["approximate"] in ("none", "tanh") and _fits(self.metas, b["input"]):
                return Match("gelu", n, [n], {"x": b["input"]}, {"approximate": b["approximate"]})
        if kind == "grouped_mm":
            found = grouped_mm_at(n, self.metas, self.consts)
            return Match("grouped_mm", n, found[1], found[0]) if found else None
        if kind == "sdpa":
            return self.sdpa(n)
        if kind == "layer_norm":
            return self.layer_norm(n)
        if kind == "rms_norm":
            return self.rms_norm(n)
        written = rms_norm_at(n)
        if written is not None:
            return self.rms_norm_written(*written)
        gate = silu_mul_at(n)
        if gate is not None:
            return self.silu_mul(*gate)
        rope = rope_at(n)
        if rope is not None:
            return self.rope(*rope)
        if kind in S.OPS and self.sorting:
            b = bind(n)
            if b is None or not isinstance(b["input"], Node) or not _meta(self.metas, b["input"]):
                return None
            if any(isinstance(v, Node) for k, v in b.items() if k not in ("input", "q")):
                return None
            v = S.variant(kind, b)
            if v is not None:
                return Match("sorting", n, [n], {"x": b["input"]}, {"op": kind, "variant": v[0],
                                                                   "args": v[1]})
        return None

    # ------------------------------------------------------------------ GEMM with a weight
    def gemm_const(self, n: Node, kind: str) -> Match | None:
        b = bind(n, kind)
        if b is None:
            return None
        views, transposed = [], False
        if kind == "linear":
            x, w, bias = b["input"], b["weight"], b["bias"]
            w, casts = _through_cast(w, self.consts)
            views += casts
            if w not in self.consts or not _fits(self.metas, w, rank=(2,)):
                return None
        else:
            if kind == "addmm":
                if b["beta"] != 1 or b["alpha"] != 1:
                    return None
                bias, x, y = b["input"], b["mat1"], b["mat2"]
            else:
                bias, x, y = None, b["input"], b["other" if kind == "matmul" else "mat2"]
            if not isinstance(y, Node):
                return None
            y, casts = _through_cast(y, self.consts, self.metas)
            views += casts
            w = _transposed_const(y, self.metas, self.consts)
            if w is not None:
                if all(u is n or u in views for u in y.users):
                    views.append(y)
            elif y in self.consts and _fits(self.metas, y, rank=(2,)):
                w, transposed = y, True
            else:
                return None
        if bias is not None:
            bias, casts = _through_cast(bias, self.consts)
            views += casts
            if bias not in self.consts or not _fits(self.metas, bias, rank=(1,)):
                return None
        x_rank = (2,) if kind in ("mm", "addmm") else tuple(range(2, 9))
        if not isinstance(x, Node) or not _fits(self.metas, x, rank=x_rank):
            return None
        dt = _dtype(self.metas, x)
        if _dtype(self.metas, n) != dt:
            return None
        covers = views + [n]
        if kind in ("mm", "addmm"):
            flat = _flattened(self.metas, x, n)
            if flat is not None:  # an N-D linear written as rows (transformers' Conv1D)
                x, out_view, x_views = flat
                covers += x_views + [out_view]
                n = out_view
        inputs = {"x": x, "weight": w, "transposed": transposed, "bias": bias, "residual": None}
        user = _sole_user(n)
        if bias is None and user is not None and canon(user) == "topk":
            m = self._topk_after(n, user, inputs, covers)
            if m is not None:
                return m
        epilogue, cur = "none", n
        plain = Match("linear", n, list(covers), dict(inputs), {"epilogue": "none"})
        end = self.gelu_of.get(n)
        if end is not None and _dtype(self.metas, end) == dt:  # a hand-written GELU
            epilogue = "gelu" if self.gelus[end][2] == "none" else "gelu_tanh"
            covers += self.gelus[end][1]
            cur = end
        elif user is not None and canon(user) in ACTIVATIONS and not (
                canon(user) == "silu" and _sole_user(user) is not None and
                silu_mul_at(_sole_user(user)) is not None):   # SwiGLU's gate: silu_mul's
            bu = bind(user)
            if bu is not None and bu["input"] is cur:
                if canon(user) != "gelu":
                    epilogue = canon(user)
                elif bu["approximate"] in ("none", "tanh"):
                    epilogue = "gelu" if bu["approximate"] == "none" else "gelu_tanh"
                if epilogue != "none":
                    covers.append(user)
                    cur = user
        user = _sole_user(cur)
        if user is not None and canon(user) == "dropout":  # a no-op in eval (BERT's outputs)
            bd = bind(user)
            if bd is not None and bd["input"] is cur and \
                    (bd["training"] is False or bd["p"] == 0) and bd["inplace"] is False:
                covers.append(user)
                cur = user
                user = _sole_user(cur)
        if user is not None and canon(user) == "add":
            bu = bind(user)
            if bu is not None and bu["alpha"] == 1:
                other = bu["other"] if bu["input"] is cur else bu["input"]
                # a bf16 product joining a float32 residual stream (autocast): the sum is
                # float32, and the kernel adds the product to it unrounded
                res_dt = torch.float32 if dt == torch.bfloat16 and \
                    _dtype(self.metas, other) == torch.float32 else dt
                if other is not cur and isinstance(other, Node) and \
                        _fits(self.metas, other, user, dtype=res_dt) and \
                        cur in (bu["input"], bu["other"]):
                    without = Match("linear", cur, list(covers), dict(inputs),
                                    {"epilogue": epilogue}, [plain] if cur is not n else [])
                    inputs["residual"] = other
                    m = Match("linear", user, covers + [user], inputs, {"epilogue": epilogue},
                              [without])
                    return m
        return Match("linear", cur, covers, inputs, {"epilogue": epilogue},
                     [plain] if epilogue != "none" else [])

    def _topk_after(self, n, user, inputs, covers) -> Match | None:
        bt = bind(user)
        rank = len(_meta(self.metas, inputs["x"]).shape)
        if bt is None or bt["input"] is not n or bt["sorted"] is not True:
            return None
        if bt["dim"] not in (-1, rank - 1) or not isinstance(bt["k"], int):
            return None
        if not isinstance(bt["largest"], bool):
            return None
        fallback = [Match("linear", n, list(covers), dict(inputs), {"epilogue": "none"})]
        if self.sorting:
            fallback.append(Match("sorting", user, [user], {"x": n},
                                  {"op": "topk", "variant": "topk",
                                   "args": S.variant("topk", bt)[1]}))
        return Match("linear_topk", user, covers + [user], dict(inputs),
                     {"k": bt["k"], "largest": bt["largest"]}, fallback)

    # ------------------------------------------------------------ GEMM of two activations
    def gemm(self, n: Node, kind: str) -> Match | None:
        b = bind(n, kind)
        if b is None:
            return None
        a, y = b["input"], b["other" if kind == "matmul" else "mat2"]
        ranks = {"mm": ((2,), (2,)), "bmm": ((3,), (3,)),
                 "matmul": (tuple(range(2, 9)), tuple(range(2, 9)))}[kind]
        if not (isinstance(a, Node) and isinstance(y, Node)):
            return None
        if not (_fits(self.metas, a, rank=ranks[0]) and
                _fits(self.metas, y, n, rank=ranks[1], dtype=_dtype(self.metas, a))):
            return None
        ra, ry = len(self.metas[a].shape), len(self.metas[y].shape)
        if ry != 2 and ra != ry:
            return None
        return Match("matmul", n, [n], {"a": a, "b": y}, {})

    # ----------------------------------------------------------------------- layer norm
    def layer_norm(self, n: Node) -> Match | None:
        """LayerNorm over the last dim, with constant (or no) weight and bias: float32 ones, or
        of x's dtype (ATen's mixed bf16 input with float32 parameters included)."""
        b = bind(n, "layer_norm")
        if b is None:
            return None
        x, shape, eps = b["input"], b["normalized_shape"], b["eps"]
        if not isinstance(x, Node) or not _fits(self.metas, x, n, rank=tuple(range(1, 9))):
            return None
        dt = _dtype(self.metas, x)
        if _dtype(self.metas, n) != dt or not isinstance(shape, (list, tuple)) or \
                len(shape) != 1 or type(shape[0]) is not int or \
                not isinstance(eps, (int, float)) or isinstance(eps, bool):
            return None
        covers, inputs = [n], {"x": x}
        for key in ("weight", "bias"):
            v, casts = (None, []) if b[key] is None else _through_cast(b[key], self.consts)
            if v is not None and (v not in self.consts or not _fits(self.metas, v, rank=(1,))
                                  or _dtype(self.metas, v) not in (dt, torch.float32)):
                return None
            covers[:0] = casts
            inputs[key] = v
        return self._with_cast(Match("layer_norm", n, covers, inputs,
                                     {"d": shape[0], "eps": float(eps), "norm": "layer"}))

    def _with_cast(self, m: Match) -> Match:
        """A float32 norm read only by autocast's cast to bf16 (for the bf16 product after it,
        a pre-LN block's float32 residual stream): the cast too, the kernel writing bf16; the
        norm alone if that fails."""
        user = _sole_user(m.output)
        if user is None or cast_source(user) is not m.output or \
                _dtype(self.metas, m.output) != torch.float32 or \
                _dtype(self.metas, user) != torch.bfloat16:
            return m
        return Match("layer_norm", user, m.covers + [user], dict(m.inputs),
                     {**m.params, "out": torch.bfloat16}, [m])

    def rms_norm(self, n: Node) -> Match | None:
        """``F.rms_norm`` over the last dim with a constant (or no) weight."""
        b = bind(n, "rms_norm")
        if b is None:
            return None
        x, shape, eps = b["input"], b["normalized_shape"], b["eps"]
        if not isinstance(x, Node) or not isinstance(shape, (list, tuple)) or len(shape) != 1 \
                or type(shape[0]) is not int:
            return None
        if eps is None:  # ATen's default: the machine epsilon of the type it computes in
            eps = torch.finfo(torch.float32).eps
        return self._rms(x, b["weight"], eps, [n], n, "rms", shape[0])

    def rms_norm_written(self, x, weight, eps, covers, out, offset, norm) -> Match | None:
        m = _meta(self.metas, x)
        d = m.shape[-1] if m is not None and m.shape else None
        return self._rms(x, weight, eps, covers, out, norm, d, offset)

    def _rms(self, x, weight, eps, covers, out, norm: str, d, offset=0.0) -> Match | None:
        """``offset``: the kernel's weight is ``weight + offset`` in float32 (Gemma's 1 + w)."""
        if not isinstance(x, Node) or not _fits(self.metas, x, out, rank=tuple(range(1, 9))):
            return None
        dt = _dtype(self.metas, x)
        if _dtype(self.metas, out) != dt or type(d) is not int or \
                not isinstance(eps, (int, float)) or isinstance(eps, bool):
            return None
        w, casts = (None, []) if weight is None else _through_cast(weight, self.consts)
        if w is not None and (w not in self.consts or not _fits(self.metas, w, rank=(1,))
                              or _dtype(self.metas, w) not in (dt, torch.float32)):
            return None
        if offset and _dtype(self.metas, w) != torch.float32 and \
                not any(cast_of(c) is w for c in covers):
            return None   # 1 + w added in w's dtype, not in float32 as the kernel adds it
        params = {"d": d, "eps": float(eps), "norm": norm}
        if offset:
            params["offset"] = float(offset)
        return self._with_cast(Match("layer_norm", out, casts + covers,
                                     {"x": x, "weight": w, "bias": None}, params))

    def rope(self, x: Node, c: Node, s: Node, h: int, dims: set, covers: list) -> Match | None:
        """Rotary embedding of a (B, H, T, d) ``x``, ``h = d / 2``, with ``cos``/``sin`` of
        x's dtype and rank broadcast to it (the kernel reads any such layout per call), or
        float32 ones with a bf16 x (autocast: the product promotes to float32)."""
        mx, mc = _meta(self.metas, x), _meta(self.metas, c)
        if mx is None or mc is None or not _fits(self.metas, x, rank=(4,)) or \
                not _fits(self.metas, c, s, covers[-1], dtype=mc.dtype, rank=(4,)) or \
                mx.dtype not in (mc.dtype, torch.bfloat16 if mc.dtype == torch.float32 else None):
            return None
        d = mx.shape[-1]
        if type(d) is not int or d != 2 * h or not dims <= {-1, 3}:
            return None
        for t in (c, s):  # sizes known here must broadcast; the kernel checks the rest
            mt = _meta(self.metas, t)
            if mt.shape[-1] != d or any(type(a) is int and type(b) is int and a not in (1, b)
                                        for a, b in zip(mt.shape, mx.shape)):
                return None
        return Match("rope", covers[-1], covers, {"x": x, "cos": c, "sin": s}, {"d": d})

    def silu_mul(self, g: Node, u: Node, covers: list) -> Match | None:
        """``silu(g) * u`` of two tensors of one shape and dtype (no broadcasting)."""
        mg, mu = _meta(self.metas, g), _meta(self.metas, u)
        if mg is None or mu is None or not _fits(self.metas, g, u, covers[-1]) or \
                mg.dtype != mu.dtype or _dtype(self.metas, covers[-1]) != mg.dtype or \
                tuple(mg.shape) != tuple(mu.shape):
            return None
        return Match("silu_mul", covers[-1], covers, {"x": g, "y": u})

    # ------------------------------------------------------------------------ attention
    def sdpa(self, n: Node) -> Match | None:
        b = bind(n, "sdpa")
        if b is None:
            return None
        q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
        if not all(isinstance(t, Node) for t in (q, k, v)):
            return None
        if not _fits(self.metas, q, k, v, rank=(3, 4), dtype=_dtype(self.metas, q)):
            return None
        if b["dropout_p"] != 0 or not isinstance(b["is_causal"], bool):
            return None
        if b["enable_gqa"] is not False and (b["enable_gqa"] is not True or
                                             len(self.metas[q].shape) != 4):
            return None
        covers, casts = [n], {}
        # grouped-query attention written as repeated k/v heads: read the unrepeated ones (and
        # where autocast casts the repeated heads, cast the unrepeated ones: 1/r of the bytes)
        for key in ("k", "v"):
            rk = repeated_kv(k if key == "k" else v, self.metas)
            if rk is not None and all(len(c.users) == 1 for c in rk[1]):
                covers[:0] = rk[1]
                if rk[2] is not None:
                    casts[key] = rk[2]
                if key == "k":
                    k = rk[0]
                else:
                    v = rk[0]
        scale = b["scale"]  # 0.0 would read as "default" to the kernel: leave it to ATen
        if scale is not None and (not isinstance(scale, (int, float)) or scale == 0):
            return None
        mask_kind = None
        if mask is not None and not b["is_causal"] and every_key_visible(mask, self.metas.get(q)):
            mask = None   # read by nothing: the kernel runs unmasked
        if mask is not None:
            mm = _meta(self.metas, mask)
            if mm is None or b["is_causal"]:
                return None
            mask_kind = "bool" if mm.dtype == torch.bool else \
                "float" if mm.dtype == _dtype(self.metas, q) else None
            if mask_kind is None:
                return None
        return Match("sdpa", n, covers, {"q": q, "k": k, "v": v, "mask": mask},
                     {"causal": b["is_causal"], "scale": None if scale is None else float(scale),
                      "mask": mask_kind, "casts": casts})

    def written_attention(self, n: Node) -> Match | None:
        """``softmax(q @ k^T * c [+ mask]) @ v`` written out (composite.attention_at) as the
        SDPA kernel, which gives what it gives (a row with no finite score NaN, the output
        contiguous). q, k, v, the scores and the output all in one dtype: under autocast the
        products and the softmax run in different ones, left to ATen."""
        def rank(x):
            m = _meta(self.metas, x)
            return len(m.shape) if m is not None else None
        found = attention_at(n, rank)
        if found is None:
            return None
        q, k, v, mask, kind, fill, scale, softmax_dtype, covers = found
        dt = _dtype(self.metas, q)
        if not _fits(self.metas, q, k, v, n, rank=(3, 4), dtype=dt) or \
                softmax_dtype not in (None, torch.float32) or \
                any(_dtype(self.metas, c) != dt for c in covers
                    if _meta(self.metas, c) and not is_softmax(c) and cast_of(c) is None):
            return None
        # one batch shape for q, k, v and the output, but for k and v's one head that the
        # products broadcast to every query head (multi-query attention: the kernel's grouped
        # form); the kernel broadcasts nothing else (matmul would)
        lq_, lk_, lv_, lo_ = (tuple(self.metas[t].shape[:-2]) for t in (q, k, v, n))
        if lo_ != lq_ or lk_ != lv_ or not (lk_ == lq_ or len(lq_) == 2 and
                                             lk_ == (lq_[0], 1)):
            return None
        if mask is not None:
            mm = _meta(self.metas, mask)
            if mm is None or mm.dtype != (torch.bool if kind == "fill" else dt) or \
                    len(mm.shape) > len(self.metas[q].shape):
                return None
        # if the kernel does not build (a bf16 shape left to ATen on AMX), its two products
        # are what they would have been without it
        products = [(c, canon(c)) for c in covers if canon(c) in ("matmul", "bmm")]
        fallback = [g for g in (self.gemm(c, kind_) for c, kind_ in products) if g is not None]
        return Match("sdpa", n, covers, {"q": q, "k": k, "v": v, "mask": mask},
                     {"causal": False, "scale": float(scale), "mask": kind, "written": True,
                      "fill": fill}, fallback)


def why_not(node: Node, metas: dict) -> str:
    """A user-facing reason why ``node`` matched no kernel pattern."""
    if "kwker.decompose" in node.meta:
        return node.meta["kwker.decompose"]
    for a in node.all_input_nodes:
        m = _meta(metas, a)
        if m is not None and m.dtype == torch.float16:
            return (f"{m.dtype} input (no float16 dot product on x86-64 CPUs without "
                    "AVX512_FP16; Kwker kernels run in float32 and bfloat16)")
        if m is not None and m.dtype not in KERNEL_DTYPES and m.dtype.is_floating_point:
            return f"{m.dtype} input (Kwker kernels run in float32 and bfloat16)"
        if m is not None and m.device != "cpu":
            return f"{m.device} input (Kwker kernels run on the CPU)"
    return "its arguments fit no Kwker kernel (shapes, flags or non-constant weights)"
