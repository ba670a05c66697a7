"""Attention's builder: ``scaled_dot_product_attention`` and attention written out
(``softmax(q @ k^T * scale [+ mask]) @ v``, patterns.py) -> the fused attention kernel.

A constant causal mask (folded by fold.py) runs as ``causal``; bf16 shapes without a tile path
stay on ATen on CPUs with AMX tiles (ATen's runs there); varying batch or lengths take the
kernel generic over them.
"""
from __future__ import annotations

import math

import torch

from ..codegen.attention_args import DIRECT_MAX_LQ
from ..codegen.attention_tile import tile_path_fits
from ..runtime.target import host_target
from .fold import ATTR as _FOLDED_ATTR
from .generic import pinned
from .make import generic, known, make_kernel, mark_generic
from .patterns import Match
from .shapes import TensorMeta

# measured on Emerald Rapids: Kwker's bf16 attention with vector products at 0.37-0.84x
# ATen's flash attention, whose products run on the tile unit; shapes without a tile path
# (codegen/attention_tile.py) stay on ATen there, but for a few queries (a decode step), whose
# dot products read K in place (attention.py's direct path): Xeon with AMX, 2 threads, bf16,
# 12 heads of 64, one query, 160 and 250 keys, with and without a mask, 1.3-1.6x ATen's with
# the caches hot and cold (36.7 against 55.9 us at 160 keys, cold), the same error
ATTENTION_ON_ATEN = ("bf16 attention of this shape stays on ATen on a CPU with AMX tiles "
                     "(ATen's runs on them; Kwker's tile path needs equal head sizes, a "
                     "multiple of 16, and more than 4 queries)")


def written_attention_aten(q, k, v, mask, scale: float, fill: float = -math.inf) -> torch.Tensor:
    """``softmax(q @ k^T * scale [+ mask | masked_fill(mask, fill)]) @ v`` as ATen computes it
    written out (a bool mask is ``masked_fill``'s condition): for inputs the kernel does not
    take."""
    s = (q @ k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(mask, fill) if mask.dtype == torch.bool else s + mask
    return s.softmax(-1) @ v


FOLDED = _FOLDED_ATTR.format("")   # the graph attributes fold.py makes
# an additive mask entry this low is a masked key: score + it underflows exp to 0 next to any
# visible key's score
MASKED_BELOW = -1e30


def causal_mask(m: Match, consts, lq: int, lk: int) -> bool:
    """Whether written attention's mask is a constant Kwker folded (fold.py) that is the
    causal pattern: an additive mask of 0 on and below the diagonal and -inf or a value below
    ``MASKED_BELOW`` above it (transformers' masks of finfo.min), or a ``masked_fill``
    condition true exactly above it, filled with such a value (``tril(ones(T, T)) == 0`` built
    in forward). Such a mask runs as ``causal``, skipping the masked blocks, where a row always
    keeps its first key (no row is fully masked)."""
    node, kind = m.inputs["mask"], m.params["mask"]
    if not (m.params.get("written") and kind in ("float", "fill") and node in consts and
            node.op == "get_attr" and str(node.target).startswith(FOLDED)):
        return False
    t = consts[node]
    if t.dim() < 2 or tuple(t.shape[-2:]) != (lq, lk):
        return False
    keep = torch.ones(lq, lk, dtype=torch.bool).tril()
    if kind == "fill":
        return m.params["fill"] < MASKED_BELOW and torch.equal(t, ~keep.expand_as(t))
    return bool((t[..., keep] == 0).all()) and bool((t[..., ~keep] < MASKED_BELOW).all())


def build_sdpa(m: Match, metas, consts):
    fn, why = _build_sdpa(m, metas, consts)
    return with_casts(fn, m.params.get("casts")), why


def with_casts(fn, casts: dict | None):
    """``fn`` taking k or v before autocast's cast, which patterns.sdpa moved from the repeated
    heads of grouped-query attention to the unrepeated ones (``casts``: "k"/"v" -> dtype)."""
    if fn is None or not casts:
        return fn
    ck, cv = casts.get("k"), casts.get("v")

    def cast(q, k, v, *mask):
        return fn(q, k if ck is None else k.to(ck), v if cv is None else v.to(cv), *mask)
    for attr in ("kwker_specs", "kwker_stand_in"):   # what reports and the tuner read
        if hasattr(fn, attr):
            setattr(cast, attr, getattr(fn, attr))
    return mark_generic(cast, generic(fn))


def _build_sdpa(m: Match, metas, consts):
    qm, km, vm = (metas[m.inputs[k]] for k in "qkv")
    target = host_target()
    if qm.dtype == torch.bfloat16 and target.tiles == "amx":
        lq, e, ev = qm.shape[-2], qm.shape[-1], vm.shape[-1]
        few = known(lq) and lq <= DIRECT_MAX_LQ
        if not (few or known(e, ev) and tile_path_fits(lq if known(lq) else None, e, ev,
                                                       target)):
            return None, ATTENTION_ON_ATEN
    three = len(qm.shape) == 3
    if not len(qm.shape) == len(km.shape) == len(vm.shape):
        return None, "q, k, v of different ranks"
    q4, k4, v4 = ((1, *t.shape) if three else t.shape for t in (qm, km, vm))
    (b, h, lq, e), (bk, hk, lk, ek), (bv, hv, lv, ev) = q4, k4, v4
    # heads and head sizes shape the kernel: symbolic ones are pinned (dynamo guards on them;
    # under dynamic=True every size is symbolic, these never vary in practice)
    h, hk, hv, e, ek, ev = (pinned(d, True) for d in (h, hk, hv, e, ek, ev))
    if not known(h, hk, hv, e, ek, ev):
        return None, "heads or head sizes vary at run time (they shape the kernel)"
    if not known(b, lq, lk, bk, bv, lv):
        return _sdpa_generic(m, metas, three, h, hk, e, ev)
    if b != bk or b != bv or hk != hv or h % hk or e != ek or lk != lv or (three and h != hk):
        return None, "broadcast batch or heads"
    if 0 in (b, h, lq, lk, e, ev):
        return None, "empty input"
    mask_shape, causal, kind = None, m.params["causal"], m.params["mask"]
    if causal_mask(m, consts, lq, lk):
        causal, kind = True, None
    elif m.inputs["mask"] is not None:
        ms = metas[m.inputs["mask"]].shape
        if len(ms) > 4:
            return None, "mask of rank > 4"
        mask_shape = (1,) * (4 - len(ms)) + tuple(ms)
        if any(s not in (1, full) for s, full in zip(mask_shape, (b, h, lq, lk))):
            return None, f"mask shape {ms} does not broadcast to {(b, h, lq, lk)}"
    # 4-D q/k/v views with a unit last stride (e.g. heads side by side in one projection) are
    # read in place, and the output is written in the layout ATen gives it
    strides = None
    om = metas.get(m.output)
    if not three and isinstance(om, TensorMeta) and all(
            t.stride[-1] == 1 and min(t.stride) >= 0 for t in (qm, km, vm, om)):
        strides = (qm.stride, km.stride, vm.stride, om.stride)
    gqa = {} if hk == h else {"kv_heads": hk}  # grouped-query: kv head h // (H / Hkv)
    fn, why = make_kernel("make_sdpa", b, h, lq, lk, e, ev, causal, m.params["scale"],
                          kind, mask_shape=mask_shape, strides=strides,
                          dtype=qm.dtype, written=m.params.get("written", False),
                          fill=m.params.get("fill", -math.inf), **gqa)
    if fn is None:
        return None, why
    if kind is None and m.inputs["mask"] is not None:   # a causal mask, not read
        fn3 = fn
        if three:
            return (lambda q, k, v, mask: fn3(q[None], k[None], v[None])[0]), None
        return (lambda q, k, v, mask: fn3(q, k, v)), None
    if three:
        if mask_shape is None:
            return (lambda q, k, v: fn(q[None], k[None], v[None])[0]), None
        return (lambda q, k, v, mask: fn(q[None], k[None], v[None],
                                         mask.reshape(mask_shape))[0]), None
    if mask_shape is None:
        return fn, None
    return (lambda q, k, v, mask: fn(q, k, v, mask.reshape(mask_shape))), None


def _sdpa_generic(m: Match, metas, three: bool, h: int, hk: int, e: int, ev: int):
    """Attention whose batch or lengths vary: one kernel generic over them (q, k and v are read
    in place where their rows are contiguous; the output comes in ATen's layout)."""
    if h % hk or e != metas[m.inputs["k"]].shape[-1] or (three and h != hk):
        return None, "broadcast batch or heads"
    pattern = None
    if m.inputs["mask"] is not None:
        ms = metas[m.inputs["mask"]].shape
        if len(ms) > 4:
            return None, "mask of rank > 4"
        # 1: broadcast along that dim; 0: as long as q/k (checked by the kernel per call)
        pattern = tuple(1 if d == 1 else 0 for d in (1,) * (4 - len(ms)) + tuple(ms))
    gqa = {} if hk == h else {"kv_heads": hk}
    fn, why = make_kernel("make_sdpa", None, h, None, None, e, ev, m.params["causal"],
                          m.params["scale"], m.params["mask"], mask_shape=pattern,
                          dtype=metas[m.inputs["q"]].dtype, written=m.params.get("written", False),
                          fill=m.params.get("fill", -math.inf), **gqa)
    if fn is None:
        return None, why
    lead = (1,) * (4 - len(pattern or ()))

    def as4d(mask):
        return mask.reshape(*lead, *mask.shape)
    if three:
        if pattern is None:
            return mark_generic(lambda q, k, v: fn(q[None], k[None], v[None])[0], True), None
        return mark_generic(lambda q, k, v, mask: fn(q[None], k[None], v[None], as4d(mask))[0],
                            True), None
    if pattern is None:
        return mark_generic(fn, True), None
    return mark_generic(lambda q, k, v, mask: fn(q, k, v, as4d(mask)), True), None
