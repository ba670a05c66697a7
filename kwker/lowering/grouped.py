"""A mixture of experts' grouped matmul with constant expert weights (kernels/grouped.py).

transformers' MoE layers sort the (token, expert) pairs by expert and multiply each expert's run
of rows by its weight in one call: ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` for
weights stored as ``nn.Linear``'s (E, N, K), or ``w`` itself for (E, K, N); under
``torch.compile`` in float32 the same call goes to transformers' own fallback op.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from ..kernels._call import KERNEL_DTYPES
from .ops import bind, op_name
from .shapes import TensorMeta


def _meta(metas, n) -> TensorMeta | None:
    m = metas.get(n) if isinstance(n, Node) else None
    return m if isinstance(m, TensorMeta) and m.device == "cpu" else None


def _swapped(w: Node) -> bool:
    """Whether ``w`` swaps the last two dims of a 3-D tensor."""
    name = op_name(w)
    if name == "transpose" and len(w.args) == 3:
        return {w.args[1], w.args[2]} in ({-1, -2}, {1, 2}, {1, -1}, {-2, 2})
    return name == "permute" and tuple(w.args[1:]) in ((0, 2, 1), ([0, 2, 1],))


def grouped_mm_at(n: Node, metas, consts) -> tuple[dict, list] | None:
    """(inputs, the nodes covered) of a grouped matmul ``n`` Kwker runs: x (S, K) float32 or
    bf16, a constant weight of x's dtype (or its last two dims swapped, a view then covered
    with ``n``), run ends ``offs`` (E,), no bias, no other output dtype."""
    b = bind(n, "grouped_mm")
    if b is None or b["bias"] is not None or not isinstance(b["offs"], Node) \
            or not isinstance(b["mat2"], Node):
        return None
    w, covers, transposed = b["mat2"], [n], False
    if w not in consts and _swapped(w) and len(w.users) == 1:
        w, covers, transposed = w.args[0], [w, n], True
    x, offs, wm = (_meta(metas, v) for v in (b["input"], b["offs"], w))
    if w not in consts or x is None or offs is None or wm is None:
        return None
    if len(x.shape) != 2 or len(wm.shape) != 3 or len(offs.shape) != 1:
        return None
    if x.dtype not in KERNEL_DTYPES or wm.dtype != x.dtype or offs.dtype.is_floating_point \
            or b["out_dtype"] not in (None, x.dtype):
        return None
    return {"x": b["input"], "weight": w, "offs": b["offs"], "transposed": transposed}, covers


def expert_weights(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weights as (E, N, K), each expert's in ``nn.Linear``'s layout."""
    return weight.detach() if transposed else weight.detach().transpose(1, 2)


def even_runs(meta: TensorMeta, rows: int) -> torch.Tensor:
    """Run ends ``offs`` splitting ``rows`` evenly between the experts: what the tuner times
    a grouped matmul on (random integers are no valid routing)."""
    experts = meta.shape[0]
    return (torch.arange(1, experts + 1) * rows // experts).to(meta.dtype)
