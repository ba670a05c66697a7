"""``make_sdpa``: fused flash-style scaled dot-product attention, for fixed shapes or generic."""
from __future__ import annotations

import ctypes
import math
import struct

import torch

from ..codegen.attention_tile import tile_path_fits
from ..runtime.kernel import get_kernel
from ..runtime.target import host_target
from . import blocking
from ._call import KERNEL_DTYPES, _profiler_enabled, contiguous_strides, entry, record_function
from .specs import AttentionSpec

# keys in one block on the tile path: all of them up to this many (a thread's scores of 32
# queries, 1 MB at most), 2048 for a kernel generic over the length
TILE_KEYS, TILE_KEYS_GENERIC = 8192, 2048


def _blocking(lq: int | None, lk: int | None, e: int, ev: int, dtype: str = "f32") -> dict:
    if dtype == "bf16" and tile_path_fits(lq, e, ev, host_target()):
        # 32-query blocks of 2 x 2 tiles; the keys in as few blocks as fit, whole 32-key
        # panels: P V then runs as long tile products and O is rescaled once per block
        # (Emerald Rapids, 2 threads, causal bf16, blocks of 256 keys against all of them:
        # (1,16,1024,64) 4.89 -> 3.57 ms, (1,8,4096,64) 40.4 -> 27.7, (2,8,1024,128) 7.6 ->
        # 4.6; the longest block was the fastest at every length measured)
        bk = TILE_KEYS_GENERIC if lk is None else min(TILE_KEYS, -(-lk // 32) * 32)
        return dict(bq=32, bk=bk, nr=32, mrs=12, mro=12, path="tile")
    lanes = blocking.lanes()
    nr = 2 * lanes
    ev_vecs = -(-ev // lanes)
    regs = 32 if lanes == 16 else 16
    if lanes == 8:  # AVX2: the output product goes by panels of 2 vectors (attention.o_panels)
        mro = 6
    else:
        mro = max(1, min(12, (regs - 4) // ev_vecs)) if ev_vecs else 12
        mro = max(1, min(mro, (regs - 2 - ev_vecs) // max(1, ev_vecs)))
    mrs = 12 if lanes == 16 else 6
    bq = mrs * 2
    bk = 256 if lk is None else min(256, -(-lk // nr) * nr)
    return dict(bq=bq, bk=bk, nr=nr, mrs=mrs, mro=mro)


def make_sdpa(batch: int, heads: int, lq: int, lk: int, e: int, ev: int, causal: bool = False,
              scale: float | None = None, mask: str | None = None, mask_shape=None,
              strides=None, dtype: torch.dtype = torch.float32, kv_heads: int | None = None,
              written: bool = False, fill: float = -math.inf):
    """``callable(q, k, v, mask=None) -> out`` for float32 or bfloat16 (B, H, L, E) inputs.

    ``mask``: None, "bool" (True keeps), "fill" (bool, True masks: ``masked_fill``'s condition)
    or "float" (added, in ``dtype``); ``mask_shape`` its 4-D shape, each dim 1 or full.
    ``fill``: what a "fill" mask puts in place of a masked (scaled) score, masked_fill's value.
    ``written``: the kernel stands for ``softmax(q @ k^T * scale + mask) @ v`` written out, and
    gives what that gives: NaN for a row with no finite score (ATen's SDPA gives 0) and a
    contiguous output, as the last product makes it. Dropout is not supported (use
    dropout_p=0). ``strides``: the 4-D strides of q, k, v and of the output (last stride 1),
    read and written in place, e.g. heads side by side in each row as
    ``nn.MultiheadAttention`` makes them; None means contiguous.
    Inputs with other strides are copied into the expected layout.

    ``dtype``: torch.float32 or torch.bfloat16 (q, k, v, float mask and output; the softmax and
    accumulation run in float32, the output is rounded once). ``kv_heads``: grouped-query
    attention, k and v are (B, kv_heads, Lk, E) and query head h reads kv head
    ``h // (heads // kv_heads)``, as ``F.scaled_dot_product_attention(..., enable_gqa=True)``.

    ``batch``, ``lq`` or ``lk`` None: the generic kernel, compiled once per (heads, e, ev, flags,
    dtype) and serving every batch, lq, lk and layout; see ``_generic``.
    """
    if dtype not in KERNEL_DTYPES:
        raise NotImplementedError(f"make_sdpa: dtype {dtype}; float32 or bfloat16 only")
    kind = mask or "none"
    if kind not in ("none", "bool", "fill", "float"):
        raise ValueError(f"make_sdpa: mask must be None, 'bool', 'fill' or 'float', not "
                         f"{mask!r}")
    if None in (batch, lq, lk):
        if strides is not None:
            raise ValueError("make_sdpa: the generic kernel reads its strides from the tensors")
        return _generic(int(heads), int(e), int(ev), bool(causal), float(scale or 0.0), kind,
                        mask_shape, dtype, _kv_heads(heads, kv_heads), bool(written),
                        float(fill))
    dims = tuple(int(d) for d in (batch, heads, lq, lk, e, ev))
    if min(dims) < 1:
        raise ValueError(f"make_sdpa: empty shapes {dims}")
    batch, heads, lq, lk, e, ev = dims
    kvh = _kv_heads(heads, kv_heads)
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
                         mask_shape, **_blocking(lq, lk, e, ev, KERNEL_DTYPES[dtype]),
                         strides=() if strides == dense else tuple(st[:3] for st in strides),
                         dtype=KERNEL_DTYPES[dtype], kv_heads=0 if kvh == heads else kvh,
                         empty_nan=bool(written), fill=float(fill))
    fn = entry(spec, 5)
    symbol = spec.symbol
    (qst, kst, vst, ost) = strides
    mdtype = torch.bool if kind in ("bool", "fill") else dtype
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


def _kv_heads(heads: int, kv_heads: int | None) -> int:
    kvh = int(kv_heads or heads)
    if kvh < 1 or heads % kvh:
        raise ValueError(f"make_sdpa: {heads} query heads are not a multiple of {kvh} kv heads")
    return kvh


def _generic(heads: int, e: int, ev: int, causal: bool, scale: float, kind: str, mask_shape,
             dtype: torch.dtype, kvh: int, written: bool, fill: float):
    """The callable of the generic kernel (codegen/attention_args.py).

    It reads batch, lq, lk and the strides from its 4-D tensors: q, k, v with last stride 1 are
    read in place whatever their other strides (heads side by side in one projection row, as
    MultiheadAttention's views), others are copied contiguous. ``mask_shape`` is 4-D with 1 on
    the dims the mask broadcasts over and 0 on full-size ones (None: all full); a mask of size 1
    on a full-size dim is broadcast too. The output has the layout ATen's CPU SDPA gives: that
    of ``torch.empty_like(q)`` when e == ev (its flash kernel), else contiguous (its math path);
    ``written``: always contiguous (see make_sdpa).
    """
    if min(heads, e, ev) < 1:
        raise ValueError(f"make_sdpa: empty shapes {(heads, e, ev)}")
    ms = ()
    if kind != "none":
        ms = (0, 0, 0, 0) if mask_shape is None else tuple(int(d) for d in mask_shape)
        ms = (1,) * (4 - len(ms)) + ms
        if len(ms) != 4 or any(d not in (0, 1) for d in ms):
            raise ValueError(f"make_sdpa: generic mask_shape {mask_shape}: 4 dims, 1 = "
                             "broadcast, 0 = full size")
    spec = AttentionSpec(0, heads, 0, 0, e, ev, causal, scale, kind, ms,
                         **_blocking(None, None, e, ev, KERNEL_DTYPES[dtype]),
                         dtype=KERNEL_DTYPES[dtype],
                         kv_heads=0 if kvh == heads else kvh, empty_nan=written, fill=fill)
    # the i64 arguments pass through ctypes as c_void_p: the same register on x86-64, at about
    # half the conversion cost of c_int64 (~0.25 us a call, 5% of a decode step)
    fn = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 10)(get_kernel(spec))
    symbol = spec.symbol
    table = struct.Struct(f"{16 if kind == 'none' else 20}q").pack
    mdtype = torch.bool if kind in ("bool", "fill") else dtype
    empty_like, empty_strided = torch.empty_like, torch.empty_strided
    threads = torch.get_num_threads
    same_e = e == ev and not written

    def inputs(q, k, v):
        """q, k, v checked, those whose last stride is not 1 made contiguous (slow path)."""
        for name, x, h, d in (("q", q, heads, e), ("k", k, kvh, e), ("v", v, kvh, ev)):
            if x.dtype != dtype:
                raise NotImplementedError(f"sdpa {name}: built for {dtype}, got {x.dtype}")
            if x.device.type != "cpu":
                raise ValueError(f"sdpa {name}: CPU tensors only, got {x.device}")
            if x.dim() != 4 or x.shape[1] != h or x.shape[3] != d:
                raise ValueError(f"sdpa {name}: expected (B, {h}, L, {d}), got {tuple(x.shape)}")
        if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0]:
            raise ValueError(f"sdpa: shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                             f"{tuple(v.shape)} do not match")
        return [x if x.stride(3) == 1 or x.shape[3] == 1 else x.contiguous() for x in (q, k, v)]

    def mask_strides(mask, full):
        """The mask and its 4-D strides over ``full``, 0 on broadcast dims; a full-size key dim
        contiguous (the kernel loads it in vectors)."""
        if mask is None:
            raise ValueError("sdpa: this kernel was built for a mask; none given")
        if mask.dtype != mdtype:
            raise NotImplementedError(f"sdpa: mask dtype {mask.dtype}, built for {mdtype}")
        if mask.dim() > 4:
            raise ValueError(f"sdpa: mask shape {tuple(mask.shape)} does not broadcast to {full}")
        pad = 4 - mask.dim()
        shape, st = (1,) * pad + tuple(mask.shape), (0,) * pad + mask.stride()
        if ms[3] == 0 and full[3] > 1 and (shape[3] == 1 or st[3] != 1):
            mask = mask.expand(shape[:3] + (full[3],)).contiguous()
            shape, st = tuple(mask.shape), mask.stride()
        for n, f, m in zip(shape, full, ms):
            if n != 1 and (n != f or m == 1):
                raise ValueError(f"sdpa: mask shape {tuple(mask.shape)} does not broadcast to "
                                 f"{full} as built ({ms}, 1 = broadcast)")
        return mask, tuple(0 if n == 1 else x for n, x in zip(shape, st))

    def run(q, k, v, mask=None):
        qst, kst, vst = q.stride(), k.stride(), v.stride()
        b, h, lq, eq = q.shape
        kb, kh, lk, ek = k.shape
        vb, vh, lv, evv = v.shape
        like = q
        if (h, eq, kb, kh, ek, vb, vh, lv, evv, qst[3], kst[3], vst[3]) != \
                (heads, e, b, kvh, e, b, kvh, lk, ev, 1, 1, 1) or q.dtype is not dtype or \
                k.dtype is not dtype or v.dtype is not dtype or not q.is_cpu:
            if qst[3] != 1 or kst[3] != 1 or vst[3] != 1:
                like = None  # ATen takes its math path then
            q, k, v = inputs(q, k, v)
            qst, kst, vst = q.stride(), k.stride(), v.stride()
        # the layout of ATen's output: its flash kernel's (that of q) or its math path's
        if same_e and like is not None and lq and lk and (
                mask is None or mask.dim() != 3 and not mask.requires_grad):
            out = empty_like(like)
        else:  # contiguous, as torch lays out empty dims too
            rows = (lq or 1) * ev
            out = empty_strided((b, heads, lq, ev), (heads * rows, rows, ev, 1), dtype=dtype)
        if not (b and lq and lk):
            return out.zero_()
        res, ost = out, out.stride()
        if ost[3] != 1:  # q's layout may not be (ties in q's strides)
            out = empty_strided((b, heads, lq, ev), (heads * lq * ev, lq * ev, ev, 1),
                                dtype=dtype)
            ost = out.stride()
        m_ptr = None
        if kind == "none":
            st = table(*qst, *kst, *vst, *ost)
        else:
            mask, mst = mask_strides(mask, (b, heads, lq, lk))
            m_ptr, st = mask.data_ptr(), table(*qst, *kst, *vst, *ost, *mst)
        if _profiler_enabled():
            with record_function(symbol):
                fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), m_ptr, out.data_ptr(), st, b, lq,
                   lk, threads())
        else:
            fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), m_ptr, out.data_ptr(), st, b, lq, lk,
               threads())
        return out if res is out else res.copy_(out)

    run.spec = spec
    if kind == "none":   # (its sizes, for kernels/kv_cache.py's step, which calls its entry)
        run.dims = (heads, kvh, e, ev, dtype)
    return run
