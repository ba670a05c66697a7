"""``make_sdpa``: fused flash-style scaled dot-product attention for fixed shapes."""
from __future__ import annotations

import torch

from . import blocking
from ._call import _profiler_enabled, checked, entry, record_function
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
              scale: float | None = None, mask: str | None = None, mask_shape=None):
    """``callable(q, k, v, mask=None) -> out`` for contiguous float32 (B, H, L, E) inputs.

    ``mask``: None, "bool" (True keeps) or "float" (added); ``mask_shape`` its 4-D shape, each
    dim 1 or full. Dropout is not supported (use dropout_p=0).
    """
    kind = mask or "none"
    if kind not in ("none", "bool", "float"):
        raise ValueError(f"make_sdpa: mask must be None, 'bool' or 'float', not {mask!r}")
    dims = tuple(int(d) for d in (batch, heads, lq, lk, e, ev))
    if min(dims) < 1:
        raise ValueError(f"make_sdpa: empty shapes {dims}")
    batch, heads, lq, lk, e, ev = dims
    full = (batch, heads, lq, lk)
    if kind != "none":
        mask_shape = tuple(int(d) for d in (mask_shape or full))
        mask_shape = (1,) * (4 - len(mask_shape)) + mask_shape
        if any(m not in (1, f) for m, f in zip(mask_shape, full)):
            raise ValueError(f"make_sdpa: mask shape {mask_shape} does not broadcast to {full}")
    else:
        mask_shape = ()
    spec = AttentionSpec(batch, heads, lq, lk, e, ev, bool(causal), float(scale or 0.0), kind,
                         mask_shape, **_blocking(lq, lk, e, ev))
    fn = entry(spec, 5)
    symbol = spec.symbol
    qs, ks, vs = (batch, heads, lq, e), (batch, heads, lk, e), (batch, heads, lk, ev)
    out_shape = (batch, heads, lq, ev)
    mdtype = torch.bool if kind == "bool" else torch.float32
    f32, empty, threads = torch.float32, torch.empty, torch.get_num_threads

    def run(q, k, v, mask=None):
        if not (q.shape == qs and q.dtype == f32 and q.is_contiguous()):
            q = checked(q, qs, "sdpa q")
        if not (k.shape == ks and k.dtype == f32 and k.is_contiguous()):
            k = checked(k, ks, "sdpa k")
        if not (v.shape == vs and v.dtype == f32 and v.is_contiguous()):
            v = checked(v, vs, "sdpa v")
        m_ptr = None
        if kind != "none":
            if mask is None:
                raise ValueError("sdpa: this kernel was built for a mask; none given")
            if mask.dtype != mdtype:
                raise NotImplementedError(f"sdpa: mask dtype {mask.dtype}, built for {mdtype}")
            mask = mask.reshape(mask_shape).contiguous()
            m_ptr = mask.data_ptr()
        out = empty(out_shape, dtype=f32)
        if _profiler_enabled():
            with record_function(symbol):
                fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), m_ptr, out.data_ptr(), threads())
        else:
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), m_ptr, out.data_ptr(), threads())
        return out

    run.spec = spec
    return run
