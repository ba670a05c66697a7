"""``make_layer_norm``: ``F.layer_norm`` over the last dim, float32 or bfloat16. A call is the
output's allocation and one kernel call: on small inputs ATen's own per-call work (dispatch,
mean and rstd outputs) costs more than the normalisation."""
from __future__ import annotations

import torch

from ..runtime.kernel import get_kernel
from ._call import ANY_ROWS, Native, _profiler_enabled, entry, kernel_dtype, record_function
from .specs import LayerNormSpec


def _param(t: torch.Tensor | None, d: int, dtype: torch.dtype, name: str):
    """A float32 contiguous copy of weight or bias, made once: later in-place changes to ``t``
    are not seen (as with make_linear's packed weights)."""
    if t is None:
        return None
    allowed = (torch.float32, torch.bfloat16) if dtype == torch.bfloat16 else (torch.float32,)
    if t.dtype not in allowed:
        raise NotImplementedError(f"make_layer_norm: {dtype} kernel, got a {t.dtype} {name}")
    if tuple(t.shape) != (d,):
        raise ValueError(f"make_layer_norm: {name} must be ({d},), got {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"make_layer_norm: CPU tensors only, got a {name} on {t.device}")
    return torch.empty(d, dtype=torch.float32).copy_(t.detach())


def _checked(x: torch.Tensor, d: int, rows: int | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` contiguous, of ``dtype``, shaped (..., d) with ``rows`` rows (None: any), or a
    useful error (slow path only)."""
    name = "kwker layer_norm input"
    if x.dtype != dtype:
        raise NotImplementedError(f"{name}: built for {dtype}, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != d:
        raise ValueError(f"{name}: expected shape (..., {d}), got {tuple(x.shape)}")
    if rows is not None and x.numel() // d != rows:
        raise ValueError(f"{name}: built for {rows} rows of {d}, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: CPU tensors only, got {x.device}")
    return x.contiguous()


def make_layer_norm(d: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                    rows: int | None = None, dtype: torch.dtype = torch.float32,
                    norm: str = "layer", out_dtype: torch.dtype | None = None):
    """``callable(x) -> F.layer_norm(x, (d,), weight, bias, eps)`` for ``x`` of shape (..., d).

    ``rows=None`` builds one kernel for any number of rows (numel // d, read per call); an int
    specialises it to that many. ``dtype`` float32 or bfloat16 is x's and the output's; bf16
    weights may be float32 or bf16, and the maths is float32 with one rounding at the store, as
    ATen computes bf16 layer_norm. weight and bias are copied to float32 here, once.

    ``norm="rms"`` is RMSNorm instead, ``x * rsqrt(mean(x^2) + eps) * weight`` (no bias) as
    ``F.rms_norm`` computes it; ``"rms_hf"`` rounds ``x * rsqrt(...)`` to ``dtype`` before the
    weight, as transformers' Llama/T5 norms do (the same in float32).

    ``out_dtype`` bfloat16 with float32 ``dtype``: the float32 result rounded once to bf16, as
    ``.to(torch.bfloat16)`` after the norm rounds it (autocast's cast for the bf16 product that
    reads a float32 norm).
    """
    if norm not in ("layer", "rms", "rms_hf"):
        raise ValueError(f"make_layer_norm: norm must be layer, rms or rms_hf, not {norm!r}")
    if norm != "layer" and bias is not None:
        raise ValueError("make_layer_norm: RMSNorm has no bias")
    dt = kernel_dtype(dtype, "make_layer_norm")
    d = int(d)
    if d < 1:
        raise ValueError(f"make_layer_norm: d must be >= 1, got {d}")
    if rows is not None and int(rows) < 1:
        raise ValueError(f"make_layer_norm: rows must be >= 1 or None (any), got {rows}")
    out_dtype = out_dtype or dtype
    if out_dtype != dtype and (dtype, out_dtype) != (torch.float32, torch.bfloat16):
        raise NotImplementedError(f"make_layer_norm: a {out_dtype} output of a {dtype} norm")
    w_c, b_c = _param(weight, d, dtype, "weight"), _param(bias, d, dtype, "bias")
    spec = LayerNormSpec(d, int(rows or 0), float(eps), w_c is not None, b_c is not None, dt,
                         norm, "" if out_dtype == dtype else kernel_dtype(out_dtype, "norm"))
    fn = entry(spec, 4, 1 if rows else 2)
    w_ptr = None if w_c is None else w_c.data_ptr()
    b_ptr = None if b_c is None else b_c.data_ptr()
    symbol, threads = spec.symbol, torch.get_num_threads
    # empty_like is cheaper than empty(shape, dtype=...) (0.8 against 1.5 us); x is contiguous
    new_out = torch.empty_like if out_dtype == dtype else \
        (lambda x: torch.empty_like(x, dtype=out_dtype))

    if rows is None:
        def run(x: torch.Tensor) -> torch.Tensor:
            if not (x.dtype == dtype and x.is_contiguous() and x.dim() and x.shape[-1] == d):
                x = _checked(x, d, None, dtype)
            out = new_out(x)
            n = x.numel() // d
            if n == 0:
                return out
            if _profiler_enabled():
                with record_function(symbol):
                    fn(x.data_ptr(), w_ptr, b_ptr, out.data_ptr(), n, threads())
            else:
                fn(x.data_ptr(), w_ptr, b_ptr, out.data_ptr(), n, threads())
            return out
    else:
        numel = int(rows) * d

        def run(x: torch.Tensor) -> torch.Tensor:
            if not (x.numel() == numel and x.dtype == dtype and x.is_contiguous() and x.dim()
                    and x.shape[-1] == d):
                x = _checked(x, d, int(rows), dtype)
            out = new_out(x)
            if _profiler_enabled():
                with record_function(symbol):
                    fn(x.data_ptr(), w_ptr, b_ptr, out.data_ptr(), threads())
            else:
                fn(x.data_ptr(), w_ptr, b_ptr, out.data_ptr(), threads())
            return out

    run.spec, run.weight, run.bias = spec, w_c, b_c  # keep the float32 copies alive
    words = (("in", 0), ("word", w_ptr), ("word", b_ptr), ("out",),
             *((("rows",),) if rows is None else ()), ("threads",))
    run.native = Native(get_kernel(spec), words, (d,), (dtype,), d, out_dtype,
                        rows=int(rows or 0), max_rows=0 if rows else ANY_ROWS)
    return run
