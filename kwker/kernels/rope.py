"""``make_rope``: rotary position embedding, ``x * cos + rotate_half(x) * sin``, as transformers'
``apply_rotary_pos_emb`` computes it, in one kernel call instead of seven ATen ops (see
codegen/rope.py). Layouts the kernel does not take run the ATen composition: the same answer."""
from __future__ import annotations

import functools

import torch

from ._call import _profiler_enabled, entry, kernel_dtype, record_function
from .specs import RopeSpec


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The ATen composition (transformers' ``rotate_half``), for layouts the kernel skips."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


@functools.lru_cache(maxsize=256)   # per layout: sequence lengths come and go
def broadcast_strides(shape, stride, x_shape) -> tuple | None:
    """The element strides of a tensor of ``shape`` and ``stride`` over the first three dims of
    ``x_shape`` once broadcast to it (0 where it broadcasts), or None when it does not broadcast
    or its rows are not dense. Worked out once per layout: a decode step asks on every call (4 us
    a layer with the caches cold, kernels/kv_cache.py)."""
    if len(shape) != 4 or stride[-1] != 1 or shape[-1] != x_shape[-1]:
        return None
    out = []
    for size, st, want in zip(shape[:3], stride[:3], x_shape[:3]):
        if size == want:
            out.append(st if want > 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def make_rope(d: int, dtype: torch.dtype = torch.float32, x_dtype: torch.dtype | None = None):
    """``callable(x, cos, sin) -> x * cos + rotate_half(x) * sin`` for ``x`` (B, H, T, d) and
    ``cos``/``sin`` broadcast to it (transformers' (B or 1, 1, T, d)), all of ``dtype``, rounded
    as eager rounds each op (bit for bit). The result has eager's layout (``empty_like(x)``:
    transformers' transposed q and k stay transposed). ``x_dtype`` bf16 with float32
    ``dtype``: bf16 x and float32 cos, sin and result, as ATen promotes them (autocast)."""
    dt = kernel_dtype(dtype, "make_rope")
    x_dtype = x_dtype or dtype
    if x_dtype != dtype and (x_dtype, dtype) != (torch.bfloat16, torch.float32):
        raise NotImplementedError(f"make_rope: {x_dtype} x with {dtype} cos and sin")
    d = int(d)
    if d < 2 or d % 2:
        raise ValueError(f"make_rope: the row length must be even, got {d}")
    spec = RopeSpec(d, dt, "" if x_dtype == dtype else kernel_dtype(x_dtype, "make_rope"))
    fn = entry(spec, 4, 13)
    symbol, threads = spec.symbol, torch.get_num_threads
    new_out = torch.empty_like if x_dtype == dtype else \
        (lambda x: torch.empty_like(x, dtype=dtype))   # x's layout, the promoted type

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape, cshape, cst = x.shape, cos.shape, cos.stride()
        sc = broadcast_strides(cshape, cst, shape) if len(shape) == 4 and shape[-1] == d \
            else None
        if sc is None or x.stride(-1) != 1 or x.dtype != x_dtype or cos.dtype != dtype or \
                sin.dtype != dtype or sin.shape != cshape or sin.stride() != cst or \
                not (x.is_cpu and cos.is_cpu and sin.is_cpu):
            return rotate_half_rope(x, cos, sin)
        out = new_out(x)
        rows = shape[0] * shape[1] * shape[2]
        if rows == 0:
            return out
        args = (x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, shape[1],
                shape[2], *x.stride()[:3], *sc, *out.stride()[:3])
        if _profiler_enabled():
            with record_function(symbol):
                fn(*args, threads())
        else:
            fn(*args, threads())
        return out

    run.spec = spec
    return run
