"""Expand fused attention-block ops, and einsums that are matmuls, into the primitives Kwker
has kernels for.

In eval mode under ``no_grad`` PyTorch runs ``nn.TransformerEncoderLayer`` as one fused op
(``torch._transformer_encoder_layer_fwd``) and ``nn.MultiheadAttention`` as
``F.multi_head_attention_forward`` or ``torch._native_multi_head_attention``; dynamo records
them as single opaque nodes. To run their linears and attention as Kwker kernels they are
rewritten here into ``linear`` / ``scaled_dot_product_attention`` / ``layer_norm`` nodes computing
the same function (the native op's order of operations: QKV projection, attention, output
projection + residual, norm, FFN + residual, norm). Only the cases spelled out below are
rewritten (no masks on the fused layer, no attention weights requested, self-attention with the
packed projection); anything else keeps its original node.

A two-operand ``torch.einsum`` that is a (batched) matrix product (one contracted index, each
operand's free index last or next to last, the output in matmul's order: ``"bhid,bhjd->bhij"``,
``"bhij,bhjd->bhid"``, ``"bld,dh->blh"``, ``"bid,jd->bij"``) becomes ``matmul`` with the
operands transposed where needed, so projections and attention written with einsum meet the
same patterns as ``@`` (linears with a weight, attention written out).
"""
from __future__ import annotations

import copy
import operator

import torch
import torch.nn.functional as F
from torch.fx import Graph, GraphModule, Node

from .autocast import regions

_TEL = torch._transformer_encoder_layer_fwd
_NATIVE_MHA = torch._native_multi_head_attention
_MHA = F.multi_head_attention_forward

TEL_PARAMS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight",
              "proj_bias", "use_gelu", "norm_first", "eps", "norm_weight_1", "norm_bias_1",
              "norm_weight_2", "norm_bias_2", "ffn_weight_1", "ffn_bias_1", "ffn_weight_2",
              "ffn_bias_2", "mask", "mask_type")
NATIVE_MHA_PARAMS = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias",
                     "proj_weight", "proj_bias", "mask", "need_weights", "average_attn_weights",
                     "mask_type")
MHA_PARAMS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight",
              "in_proj_bias", "bias_k", "bias_v", "add_zero_attn", "dropout_p",
              "out_proj_weight", "out_proj_bias", "training", "key_padding_mask", "need_weights",
              "attn_mask", "use_separate_proj_weight", "q_proj_weight", "k_proj_weight",
              "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")
_MHA_DEFAULTS = {"training": True, "key_padding_mask": None, "need_weights": True,
                 "attn_mask": None, "use_separate_proj_weight": False, "q_proj_weight": None,
                 "k_proj_weight": None, "v_proj_weight": None, "static_k": None,
                 "static_v": None, "average_attn_weights": True, "is_causal": False}


def _bind(node: Node, params: tuple, defaults: dict) -> dict | None:
    out = dict(defaults)
    if len(node.args) > len(params):
        return None
    out.update(zip(params, node.args))
    out.update(node.kwargs)
    return out if all(p in out for p in params) else None


def _value(n):
    return n.meta.get("example_value") if isinstance(n, Node) else None


def _is_float_rank(n, rank: int) -> bool:
    """A float32 or bfloat16 (dense) tensor of this rank: the dtypes Kwker's kernels run in."""
    v = _value(n)
    return isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.bfloat16) and \
        v.dim() == rank and not v.is_nested


def _in_result_dtype(e: "_Emit", node: Node, x: Node) -> Node:
    """``x`` cast to the autocast dtype when ``node`` runs under autocast: the fused ops are on
    autocast's lower-precision list (they run in bf16 on a float32 input), so the expansion
    starts with that cast; its own linears then get autocast's casts of their weights."""
    dtype, src = e.autocast.get(node), _value(x)
    if dtype is not None and isinstance(src, torch.Tensor) and src.dtype != dtype:
        return e.meth("to", x, dtype)
    return x


class _Emit:
    """Adds nodes before the node being replaced; reads like the eager code it stands for."""

    def __init__(self, graph: Graph, autocast: dict):
        self.g, self.autocast = graph, autocast

    def fn(self, target, *args, **kwargs) -> Node:
        return self.g.call_function(target, args, kwargs)

    def meth(self, name, *args) -> Node:
        return self.g.call_method(name, args)

    def attention(self, x: Node, batch_first: bool, embed: int, heads: int, w_in, b_in, w_out,
                  b_out, causal: bool) -> Node:
        """Self-attention with a packed QKV projection; x is (B, L, E) or (L, B, E)."""
        d = embed // heads
        qkv = self.meth("unflatten", self.fn(F.linear, x, w_in, b_in), -1, (3, heads, d))
        # (B, L, 3, H, D) -> (3, B, H, L, D); for (L, B, ...) inputs swap L and B
        qkv = self.meth("permute", qkv, *((2, 0, 3, 1, 4) if batch_first else (2, 1, 3, 0, 4)))
        q, k, v = (self.fn(operator.getitem, qkv, i) for i in range(3))
        a = self.fn(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
        # (B, H, L, D) -> (B, L, H*D) or (L, B, H*D)
        a = self.meth("permute", a, *((0, 2, 1, 3) if batch_first else (2, 0, 1, 3)))
        a = self.meth("flatten", a, 2)
        return self.fn(F.linear, a, w_out, b_out)


def _encoder_layer(e: _Emit, node: Node) -> Node | None:
    a = _bind(node, TEL_PARAMS, {"mask": None, "mask_type": None})
    if a is None or a["mask"] is not None or not _is_float_rank(a["src"], 3):
        return None
    src, embed, heads, eps = a["src"], a["embed_dim"], a["num_heads"], a["eps"]
    if not all(isinstance(v, int) for v in (embed, heads)) or embed % heads:
        return None
    src = _in_result_dtype(e, node, src)

    def norm(x, i):
        return e.fn(F.layer_norm, x, (embed,), a[f"norm_weight_{i}"], a[f"norm_bias_{i}"], eps)

    def attn(x):
        return e.attention(x, True, embed, heads, a["qkv_weight"], a["qkv_bias"],
                           a["proj_weight"], a["proj_bias"], False)

    def ffn(x):
        h = e.fn(F.linear, x, a["ffn_weight_1"], a["ffn_bias_1"])
        h = e.fn(F.gelu, h) if a["use_gelu"] else e.fn(torch.relu, h)
        return e.fn(F.linear, h, a["ffn_weight_2"], a["ffn_bias_2"])

    if a["norm_first"]:
        x = e.fn(operator.add, attn(norm(src, 1)), src)
        return e.fn(operator.add, ffn(norm(x, 2)), x)
    x = norm(e.fn(operator.add, attn(src), src), 1)
    return norm(e.fn(operator.add, ffn(x), x), 2)


def _pair_users_ok(node: Node) -> bool:
    """A (output, weights) result used only through ``[0]`` (the weights are None anyway)."""
    return all(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0
               for u in node.users)


def _native_mha(e: _Emit, node: Node) -> Node | None:
    a = _bind(node, NATIVE_MHA_PARAMS, {"mask": None, "need_weights": True,
                                        "average_attn_weights": True, "mask_type": None})
    if a is None or a["need_weights"] or a["mask"] is not None or not _pair_users_ok(node):
        return None
    if not (a["query"] is a["key"] is a["value"]) or not _is_float_rank(a["query"], 3):
        return None
    embed, heads = a["embed_dim"], a["num_head"]
    if not all(isinstance(v, int) for v in (embed, heads)) or embed % heads:
        return None
    return e.attention(_in_result_dtype(e, node, a["query"]), True, embed, heads,
                       a["qkv_weight"], a["qkv_bias"], a["proj_weight"], a["proj_bias"], False)


def _mha(e: _Emit, node: Node) -> Node | None:
    a = _bind(node, MHA_PARAMS, _MHA_DEFAULTS)
    if a is None or a["need_weights"] or not _pair_users_ok(node):
        return None
    if not (a["query"] is a["key"] is a["value"]) or not _is_float_rank(a["query"], 3):
        return None
    if any(a[k] is not None for k in ("bias_k", "bias_v", "key_padding_mask", "static_k",
                                      "static_v")):
        return None
    if a["add_zero_attn"] or a["use_separate_proj_weight"] or a["in_proj_weight"] is None:
        return None
    if a["training"] and a["dropout_p"] != 0:
        return None
    causal = a["is_causal"] is True
    # with a causal hint (which requires a mask) and no weights, SDPA runs causal without the mask
    if (a["attn_mask"] is None) == causal:
        return None
    embed, heads = a["embed_dim_to_check"], a["num_heads"]
    if not all(isinstance(v, int) for v in (embed, heads)) or embed % heads:
        return None
    return e.attention(_in_result_dtype(e, node, a["query"]), False, embed, heads,
                       a["in_proj_weight"], a["in_proj_bias"], a["out_proj_weight"],
                       a["out_proj_bias"], causal)


def _einsum_plan(eq: str) -> tuple[bool, bool] | None:
    """(transpose a, transpose b) making ``eq`` one ``torch.matmul`` of the two operands, or
    None. "..." counts as one batch index, leading in all three terms."""
    eq = eq.replace(" ", "")
    if eq.count("->") != 1 or eq.count(",") != 1:
        return None
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    if "..." in eq:
        if not all(t.startswith("...") and t.count("...") == 1 for t in (a, b, out)):
            return None
        a, b, out = ("#" + t[3:] for t in (a, b, out))
    terms = (a, b, out)
    if not all(t.isalpha() or t[1:].isalpha() and t[0] == "#" for t in terms if t) or \
            any(len(set(t)) != len(t) for t in terms) or len(a) < 2 or len(b) < 2:
        return None
    shared = set(a) & set(b)
    contracted = shared - set(out)
    if len(contracted) != 1 or set(out) != (set(a) | set(b)) - contracted:
        return None
    c = contracted.pop()
    ta, tb = a[-2] == c, b[-1] == c       # a: (..., x, c); b: (..., c, y)
    a2 = a[:-2] + a[-1] + a[-2] if ta else a
    b2 = b[:-2] + b[-1] + b[-2] if tb else b
    x, y, batch_a, batch_b = a2[-2], b2[-1], a2[:-2], b2[:-2]
    # batch dims align from the right, as matmul broadcasts them: the shorter run's indices
    # are in both operands, the longer's extra ones in one only
    long, short = (batch_a, batch_b) if len(batch_a) >= len(batch_b) else (batch_b, batch_a)
    if a2[-1] != c or b2[-2] != c or x in shared or y in shared or \
            not long.endswith(short) or set(short) - shared or \
            set(long[:len(long) - len(short)]) & shared or out != long + x + y:
        return None
    return ta, tb


def _einsum(e: _Emit, node: Node) -> Node | None:
    args = node.args
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    if not (args and isinstance(args[0], str)) or len(ops) != 2 or node.kwargs or \
            not all(isinstance(o, Node) for o in ops):
        return None
    plan = _einsum_plan(args[0])
    if plan is None:
        return None
    a, b = (e.fn(torch.transpose, o, -2, -1) if t else o for o, t in zip(ops, plan))
    return e.fn(torch.matmul, a, b)


_EINSUM = torch.functional.einsum
_RULES = {_TEL: _encoder_layer, _NATIVE_MHA: _native_mha, _MHA: _mha, _EINSUM: _einsum}
_ONE_VALUE = (_TEL, _EINSUM)   # rules whose node is its value (MHA's is an (out, weights) pair)
_KEPT = {  # why a fused op stays one opaque ATen call
    _TEL: "kept whole: a mask, nested or non-float32/bfloat16 input, or heads not dividing "
          "the width",
    _NATIVE_MHA: "kept whole: attention weights, a mask, or cross-attention requested",
    _MHA: "kept whole: attention weights, masks (other than a causal hint), dropout, bias_k/v, "
          "separate projections or cross-attention requested",
    _EINSUM: "kept as einsum: not one matrix product (Kwker rewrites two operands with one "
             "contracted index and free indices where matmul puts them)",
}
KEPT_NOTE = "kwker.decompose"  # node.meta key holding that reason


def _keep_value(old: Node, new: Node) -> None:
    if "example_value" in old.meta and "example_value" not in new.meta:
        new.meta["example_value"] = old.meta["example_value"]


def decompose(gm: GraphModule) -> tuple[GraphModule, list]:
    """A copy of ``gm`` with the fused blocks expanded; also [(node name, op)] of those expanded."""
    if not any(n.op == "call_function" and n.target in _RULES for n in gm.graph.nodes):
        return gm, []  # nothing to expand: no copy
    graph = copy.deepcopy(gm.graph)
    done = []
    e = _Emit(graph, regions(graph)[0])
    for node in list(graph.nodes):
        rule = _RULES.get(node.target) if node.op == "call_function" else None
        if rule is None:
            continue
        with graph.inserting_before(node):
            out = rule(e, node)
        if out is None:  # not a case we expand (rules add nodes only once they accept)
            node.meta[KEPT_NOTE] = _KEPT[node.target]
            continue
        done.append((node.name, getattr(node.target, "__name__", str(node.target))))
        # the expansion's result stands for the node's value: keep dynamo's metadata on it, so
        # a following fused block (the next layer of an nn.TransformerEncoder) still matches
        if node.target in _ONE_VALUE:
            _keep_value(node, out)
            node.replace_all_uses_with(out)
        else:
            for u in list(node.users):
                _keep_value(u, out)
                u.replace_all_uses_with(out)
                graph.erase_node(u)
        graph.erase_node(node)
    graph.lint()
    return GraphModule(gm, graph), done
