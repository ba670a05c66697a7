"""``make_sdpa``: fused flash-style scaled dot-product attention for fixed shapes."""
from __future__ import annotations

import torch

from . import blocking
from ._call import _profiler_enabled, contiguous_strides, entry, record_function
from .specs import AttentionSpec


def _blocking(lq: int, lk: int, e: int, ev: int) -> dict:
    lanes = blocking.lanes()
    nr = 2 * lanes
    ev_vecs = -(-ev // lanes)
    regs = 32 if lanes == 16 else 16
    mro = max(1, min(12, (regs - 4) // (ev_vecs + 0) - 0)) if ev_vecs else 12
    mro = max(1, min(mro, (regs - 2 - ev_vecs) // max(1, ev_vecs)))
    mrs = 12 if lanes == 16 else 6
    bq = mrs * 2
    bk = min(256, -(-lk // nr) * nr)
    return dict(bq=bq, bk=bk, nr=nr, mrs=mrs, mro=mro)


def make_sdpa(batch: int, heads: int, lq: int, lk: int, e: int, ev: int, causal: bool = False,
              scale: float | None = None, mask: str | None = None, mask_shape=None,
              strides=None, dtype: torch.dtype = torch.float32, kv_heads: int | None = None):
    """``callable(q, k, v, mask=None) -> out`` for float32 or bfloat16 (B, H, L, E) inputs.

    ``mask``: None, "bool" (True keeps) or "float" (added, in ``dtype``); ``mask_shape`` its 4-D
    shape, each dim 1 or full. Dropout is not supported (use dropout_p=0). ``strides``: the 4-D
    strides of q, k, v and of the output (last stride 1), read and written in place, e.g. heads
    side by side in each row as ``nn.MultiheadAttention`` makes them; None means contiguous.
    Inputs with other strides are copied into the expected layout.

    ``dtype``: torch.float32 or torch.bfloat16 (q, k, v, float mask and output; the softmax and
    accumulation run in float32, the output is rounded once). ``kv_heads``: grouped-query
    attention, k and v are (B, kv_heads, Lk, E) and query head h reads kv head
    ``h // (heads // kv_heads)``, as ``F.scaled_dot_product_attention(..., enable_gqa=True)``.
    """
    dts = {torch.float32: "f32", torch.bfloat16: "bf16"}
    if dtype not in dts:
        raise NotImplementedError(f"make_sdpa: dtype {dtype}; float32 or bfloat16 only")
    kind = mask or "none"
    if kind not in ("none", "bool", "float"):
        raise ValueError(f"make_sdpa: mask must be None, 'bool' or 'float', not {mask!r}")
    dims = tuple(int(d) for d in (batch, heads, lq, lk, e, ev))
    if min(dims) < 1:
        raise ValueError(f"make_sdpa: empty shapes {dims}")
    batch, heads, lq, lk, e, ev = dims
    kvh = int(kv_heads or heads)
    if kvh < 1 or heads % kvh:
        raise ValueError(f"make_sdpa: {heads} query heads are not a multiple of {kvh} kv heads")
    full = (batch, heads, lq, lk)
    if kind != "none":
        mask_shape = tuple(int(d) for d in (mask_shape or full))
        mask_shape = (1,) * (4 - len(mask_shape)) + mask_shape
        if any(m not in (1, f) for m, f in zip(mask_shape, full)):
            raise ValueError(f"make_sdpa: mask shape {mask_shape} does not broadcast to {full}")
    else:
        mask_shape = ()
    qs, ks, vs = (batch, heads, lq, e), (batch, kvh, lk, e), (batch, kvh, lk, ev)
    out_shape = (batch, heads, lq, ev)
    shapes = (qs, ks, vs, out_shape)
    dense = tuple(contiguous_strides(t) for t in shapes)
    strides = tuple(tuple(int(x) for x in st) for st in strides) if strides else dense
    if any(len(st) != 4 or st[3] != 1 or min(st) < 0 for st in strides):
        raise ValueError(f"make_sdpa: strides {strides} need 4 dims, the last 1")
    spec = AttentionSpec(batch, heads, lq, lk, e, ev, bool(causal), float(scale or 0.0), kind,
                         mask_shape, **_blocking(lq, lk, e, ev),
                         strides=() if strides == dense else tuple(st[:3] for st in strides),
                         dtype=dts[dtype], kv_heads=0 if kvh == heads else kvh)
    fn = entry(spec, 5)
    symbol = spec.symbol
    (qst, kst, vst, ost) = strides
    mdtype = torch.bool if kind == "bool" else dtype
    empty_strided, threads = torch.empty_strided, torch.get_num_threads

    def layout(x, shape, stride, name):
        if x.shape == shape and x.dtype == dtype and x.stride() == stride:
            return x
        if x.dtype != dtype:
            raise NotImplementedError(f"{name}: built for {dtype}, got {x.dtype}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
        if x.device.type != "cpu":
            raise ValueError(f"{name}: CPU tensors only, got {x.device}")
        return empty_strided(shape, stride, dtype=dtype).copy_(x)

    def run(q, k, v, mask=None):
        q, k, v = layout(q, qs, qst, "sdpa q"), layout(k, ks, kst, "sdpa k"), \
            layout(v, vs, vst, "sdpa v")
        m_ptr = None
        if kind != "none":
            if mask is None:
                raise ValueError("sdpa: this kernel was built for a mask; none given")
            if mask.dtype != mdtype:
                raise NotImplementedError(f"sdpa: mask dtype {mask.dtype}, built for {mdtype}")
            mask = mask.reshape(mask_shape).contiguous()
            m_ptr = mask.data_ptr()
        out = empty_strided(out_shape, ost, dtype=dtype)
        if _profiler_enabled():
            with record_function(symbol):
                fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), m_ptr, out.data_ptr(), threads())
        else:
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), m_ptr, out.data_ptr(), threads())
        return out

    run.spec = spec
    return run
