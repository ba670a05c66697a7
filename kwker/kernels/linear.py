"""``make_linear``: ``act(x @ W.T + bias) [+ residual]`` with W packed once, at build time."""
from __future__ import annotations

import math
import threading
import weakref

import torch
import torch.nn.functional as F

from ..runtime import huge_pages
from ..runtime.kernel import get_kernel
from . import blocking, variants
from ._call import (
    ANY_ROWS,
    Native,
    _profiler_enabled,
    checked,
    entry,
    float32_precision,
    follow_precision,
    kernel_dtype,
    on_rows,
    record_function,
)
from .specs import GemmSpec

EPILOGUES = ("none", "relu", "silu", "sigmoid", "tanh", "gelu", "gelu_tanh")


def pack_panels(w: torch.Tensor, nr: int) -> torch.Tensor:
    """(N, K) weights -> (ceil(N/nr), K, nr) k-major float32 panels, zero-padded past column N.
    Copied straight into place: no weight-sized temporaries (they would stay in the heap)."""
    n, k = w.shape
    full, rem = divmod(n, nr)
    w = w.detach().to(torch.float32)
    out = huge_pages.empty((full + (rem > 0), k, nr), torch.float32)  # streamed per token
    out[:full].copy_(w[:full * nr].view(full, nr, k).transpose(1, 2))
    if rem:
        out[full].zero_()
        out[full, :, :rem].copy_(w[full * nr:].t())
    return out


def pack_bf16_panels(w: torch.Tensor, nr: int, k_step: int = 1) -> torch.Tensor:
    """(N, K) -> int32 words (panels, ceil(K/2) rounded up to ``k_step``, nr): two bf16 (k even
    low, k odd high) per column, zero-padded past N and K (the pair-interleaved layout that
    ``vdpbf16ps`` and AMX's B tiles multiply; the tile path pads K to whole tile steps).
    float32 weights are rounded to bf16 as ``.to(torch.bfloat16)`` rounds them."""
    n, k = w.shape
    full, rem = divmod(n, nr)
    kp = -(-k // 2)
    wb = w.detach().to(torch.bfloat16)
    if k % 2:
        wb = F.pad(wb, (0, 1))
    out = huge_pages.empty((full + (rem > 0), -(-kp // k_step) * k_step, nr),
                           torch.int32).zero_()
    halves = out.view(torch.int16).view(full + (rem > 0), -1, nr, 2)[:, :kp]
    halves[:full].copy_(wb[:full * nr].view(torch.int16).view(full, nr, kp, 2)
                        .permute(0, 2, 1, 3))
    if rem:
        halves[full, :, :rem].copy_(wb[full * nr:].view(torch.int16).view(rem, kp, 2)
                                    .permute(1, 0, 2))
    return out


_shared: dict = {}
_shared_lock = threading.Lock()


def shared_panels(weight: torch.Tensor, nr: int, bf16: bool, source: torch.Tensor | None,
                  k_step: int = 1):
    """``weight`` packed in ``nr``-column panels (bf16 pairs if ``bf16``), shared per source
    (see ``shared``)."""
    return shared(source, weight, ("panels", nr, bf16, k_step),
                  lambda: pack_bf16_panels(weight, nr, k_step) if bf16 else
                  pack_panels(weight, nr))


class Packs(list):
    """Several buffers packed together, held by ``shared`` by a weak reference (which a tuple,
    even subclassed, does not take)."""


def shared(source: torch.Tensor | None, weight: torch.Tensor, layout: tuple, pack):
    """``pack()`` of ``weight`` (a tensor or ``Packs``), one copy per (source tensor, layout)
    while any kernel holds it.

    ``source`` is the tensor ``weight`` was derived from (a parameter: ``weight`` is its
    detached view, a slice of it or its transposed copy, new objects per build; the key tells
    these apart by storage, offset, strides and shape, so no other derivation may pass the same
    source). Kernels built from
    the same source for other sizes or graphs share the copy, so memory does not grow with the
    sizes seen, and a graph dynamo adds for one more size packs nothing. An in-place update of
    the source (its version) or its death retires the copy.
    """
    if source is None:
        return pack()
    try:
        version = source._version
    except RuntimeError:  # inference tensors have no version counter
        version = None
    # where ``weight`` lies in the source: a view's offset (0 for the whole of it, one expert's
    # slice of a mixture's 3-D weights further on), else a copy
    same = weight.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
    where = (weight.storage_offset(), tuple(weight.stride())) if same else "copy"
    key = (id(source), where, tuple(weight.shape), layout)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is not None:
            src_ref, ver, packed_ref = entry
            packed = packed_ref()
            if src_ref() is source and ver == version and packed is not None:
                return packed
    packed = pack()
    with _shared_lock:
        for k in [k for k, (r, _, p) in _shared.items() if r() is None or p() is None]:
            del _shared[k]
        _shared[key] = (weakref.ref(source), version, weakref.ref(packed))
    return packed


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, m: int | None = None,
                epilogue: str = "none", residual: bool = False,
                dtype: torch.dtype | None = None, source: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, lead: tuple | None = None):
    """``callable(x (m, K)[, residual (m, N)]) -> (m, N)``.

    ``lead``: the leading dims of x, the residual and the output in place of ``(m,)`` (their
    product ``m``): a (batch, seq, K) input taken as it is, without a reshape and a view
    around each call.

    ``m=None`` builds the kernel generic over the row count: one compile and one packed copy
    of the weights serve every batch size and sequence length, x of any leading dims
    (``(..., K) -> (..., N)``, as ``F.linear``). An int ``m`` specialises the
    kernel to it (the small-M schedule for decode-sized M, no run-time edge dispatch).
    ``source``: the parameter ``weight`` comes from; kernels of one source share its packed
    copy (see ``shared_panels``).

    ``dtype`` (default: the weight's) is the type of x, the residual and the output: float32,
    or bfloat16 (weights rounded to bf16 once here, the bias added in float32 to the float32
    sums, the epilogue in float32, one rounding at the end: autocast's casts and oneDNN's
    arithmetic, with fewer roundings).

    ``out_dtype`` (default ``dtype``): float32 with bf16 ``dtype`` makes the residual and the
    output float32, the product added to the residual unrounded: autocast's bf16 linear whose
    result joins a float32 residual stream (eager rounds the product to bf16 first).

    A float32 kernel built where the user allows float32 matmuls below full precision runs on
    bf16 products where they are fast (``_products``, ``_on_bf16_products``).
    """
    exact = (weight, bias, m, epilogue, residual, dtype, source, out_dtype, lead)
    mode = _products(dtype or weight.dtype, out_dtype)
    if mode is None or weight.dim() != 2:  # (bad shapes: the float32 build's errors say why)
        return _make_linear(*exact)
    lower = (weight, bias, m, epilogue, residual, source, lead, mode)
    if m is None:  # nothing to time at a runtime row count
        return _on_bf16_products(*lower)
    # measured against the float32 kernel: a small product's cast of x can cost more than the
    # bf16 products save (Zen 5: the tutorial Ranker b32 0.48 -> 0.63 ms on them)
    n, k = weight.shape
    shape = tuple(int(d) for d in lead) if lead else (int(m),)

    def inputs():
        x = torch.randn(*shape, k)
        return [x, torch.randn(*shape, n)] if residual else [x]
    problem = {"inputs": [["tensor", [int(m), k], [k, 1], "torch.float32"]], "n": n, "k": k,
               "bias": bias is not None, "epilogue": epilogue, "residual": residual,
               "float32_precision": float32_precision()}
    return variants.pick("linear products", problem, {
        f"{mode} products": lambda: _on_bf16_products(*lower),
        "float32": lambda: _make_linear(*exact)}, inputs)[1]


def _products(dtype: torch.dtype, out_dtype: torch.dtype | None) -> str | None:
    """The products a float32 linear may take below full precision here: "bf16" (x and W
    rounded to bf16) where the user allows bf16 (``set_float32_matmul_precision("medium")``)
    and they are fast (``vdpbf16ps`` or bf16 tiles); "bf16x3" (x and W each split into two
    bf16 halves, three products: about 16 bits, torch's documented form of "high") where the
    user allows TF32 and the CPU has bf16 tiles, on which three products are still several
    times float32 FMAs' speed; else None (float32)."""
    if dtype != torch.float32 or out_dtype not in (None, torch.float32):
        return None
    precision = float32_precision()
    if precision == "bf16" and blocking.fast_bf16():
        return "bf16"
    if precision == "tf32" and blocking.tiles_bf16():
        return "bf16x3"
    return None


def _on_bf16_products(weight, bias, m, epilogue, residual, source, lead, mode: str = "bf16"):
    """The float32 linear on bf16 products (``_products``' ``mode``), the sums, bias, epilogue
    and residual in float32, a float32 output.

    "bf16": x rounded per call, the weights once, as ``set_float32_matmul_precision("medium")``
    allows (eager's oneDNN does it on AMX; on Zen 5 it stays float32 there). Zen 5, 128 x 768
    -> 3072: 1.58-1.64 -> 0.87-0.97 ms.

    "bf16x3": ``x = xh + xl`` and ``W = Wh + Wl`` in bf16 halves, ``xh Wh + xh Wl + xl Wh`` as
    one bf16 GEMM over ``[xh, xh, xl]`` and ``[Wh; Wl; Wh]`` (K three times over, float32 sums):
    no kernel of its own, the weights packed once at 1.5x their float32 bytes.

    The setting is read per call: where it no longer allows these products, the call goes to
    the float32 kernel, built on first need."""
    allowed, products, by = ("bf16",), weight, source
    if mode == "bf16x3":  # [Wh, Wl, Wh] along K (Wl rounded to bf16 as it is packed)
        w = weight.detach().float()
        high = w.to(torch.bfloat16).float()
        allowed, products, by = ("tf32", "bf16"), torch.cat([high, w - high, high], 1), None
    fast = _make_linear(products, bias, m, epilogue, residual, torch.bfloat16, by,
                        torch.float32, lead, round_bias=False)
    to_bf16, cat = torch.bfloat16, torch.cat

    def operand(x):
        if mode == "bf16":
            return x.to(to_bf16)
        high = x.to(to_bf16)
        return cat([high, high, (x - high).to(to_bf16)], -1)

    run = follow_precision(allowed, lambda: lambda x, *res: fast(operand(x), *res),
                           lambda: _make_linear(weight, bias, m, epilogue, residual,
                                                torch.float32, source, None, lead))
    run.spec, run.packed_weight, run.bias = fast.spec, fast.packed_weight, fast.bias
    return run


def _make_linear(weight, bias, m, epilogue, residual, dtype, source, out_dtype, lead,
                 round_bias: bool = True):
    """``make_linear`` in the dtypes given (``round_bias=False``: a bf16 kernel's bias added as
    it is, not rounded to bf16 as autocast rounds it)."""
    dtype = dtype or weight.dtype
    dt = kernel_dtype(dtype, "make_linear")
    out_dtype = out_dtype or dtype
    if out_dtype != dtype and (dt, out_dtype) != ("bf16", torch.float32):
        raise NotImplementedError(f"make_linear: a {out_dtype} output of a {dtype} kernel "
                                  "(only bf16 inputs with a float32 output)")
    if dt == "f32":
        for t in (weight, bias):
            if t is not None and t.dtype != torch.float32:
                raise NotImplementedError(f"make_linear: float32 kernel, got a {t.dtype} weight")
    if epilogue not in EPILOGUES:
        raise ValueError(f"make_linear: epilogue must be one of {EPILOGUES}, not {epilogue!r}")
    if weight.dim() != 2:
        raise ValueError(f"make_linear: weight must be (N, K), got {tuple(weight.shape)}")
    n, k = weight.shape
    generic = m is None
    m = None if generic else int(m)
    if min(1 if generic else m, n, k) < 1:
        raise ValueError(f"make_linear: empty shapes m={m}, N={n}, K={k}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"make_linear: bias must be ({n},), got {tuple(bias.shape)}")
    lead = tuple(int(d) for d in lead) if lead else None if generic else (m,)
    if lead is not None and (generic or math.prod(lead) != m):
        raise ValueError(f"make_linear: leading dims {lead} for m={m}")
    bf16 = dt == "bf16"
    kk = k + (k % 2) if bf16 else k          # bf16 kernels step over k pairs
    bias_c = None
    if bias is not None:  # bf16: rounded as autocast rounds it, then added in float32
        bias_c = (bias.detach().to(torch.bfloat16) if bf16 and round_bias else bias.detach()) \
            .float().contiguous()
    args = (weight, bias_c, m, n, k, kk, epilogue, residual, dtype, source, out_dtype, lead)
    options = blocking.variants(m, n, kk // 2 if bf16 else k, dtype=dt)
    if len(options) == 1:
        return _build(next(iter(options.values())), *args)

    def inputs():
        x = torch.randn(*lead, k).to(dtype)
        return [x, torch.randn(*lead, n).to(out_dtype)] if residual else [x]
    problem = {"inputs": [["tensor", [m, k], [k, 1], str(dtype)]], "n": n, "k": k,
               "bias": bias is not None, "epilogue": epilogue, "residual": residual}
    if out_dtype != dtype:
        problem["out"] = str(out_dtype)
    return variants.pick("linear", problem, {name: (lambda b=blk: _build(b, *args))
                                             for name, blk in options.items()}, inputs)[1]


def _build(blk: blocking.Blocking, weight, bias_c, m, n, k, kk, epilogue, residual, dtype,
           source, out_dtype, lead):
    """The linear kernel of blocking ``blk`` and its callable (see ``make_linear``)."""
    dt = kernel_dtype(dtype, "make_linear")
    bf16, generic = dt == "bf16", m is None
    spec = GemmSpec(m or 0, n, kk, 1, "packed", bias_c is not None, epilogue, residual,
                    **blk.as_kwargs(), dtype=dt,
                    out="" if out_dtype == dtype else kernel_dtype(out_dtype, "make_linear"))
    fn = entry(spec, 5, 2 if generic else 1)
    packed = shared_panels(weight, blk.nr, bf16, source, blk.k_step)
    if generic:
        return _generic_run(fn, spec, packed, bias_c, n, k, pad=kk != k, dtype=dtype,
                            out_dtype=out_dtype)
    w_ptr = packed.data_ptr()
    b_ptr = bias_c.data_ptr() if bias_c is not None else None
    symbol, x_shape, out_shape = spec.symbol, (*lead, k), (*lead, n)
    # outputs are made empty_like this: 0.8 us against 1.5 for torch.empty(shape, dtype=...)
    template, empty_like, threads = torch.empty(out_shape, dtype=out_dtype), torch.empty_like, \
        torch.get_num_threads
    pad = kk != k

    def call(x_ptr, r_ptr, o_ptr):
        if _profiler_enabled():
            with record_function(symbol):
                fn(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, threads())
        else:
            fn(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, threads())

    def prepare(x):
        if not (x.shape == x_shape and x.dtype == dtype and x.is_contiguous()):
            x = checked(x, x_shape, "linear input", dtype)
        return F.pad(x, (0, 1)) if pad else x   # odd K: one zero column completes the last pair

    if residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            x = prepare(x)
            if not (res.shape == out_shape and res.dtype == out_dtype and res.is_contiguous()):
                res = checked(res, out_shape, "linear residual", out_dtype)
            out = empty_like(template)
            call(x.data_ptr(), res.data_ptr(), out.data_ptr())
            return out
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            if pad or not (x.shape == x_shape and x.dtype == dtype and x.is_contiguous()):
                x = prepare(x)
            out = empty_like(template)
            if _profiler_enabled():
                call(x.data_ptr(), None, out.data_ptr())
            else:   # the common case without the helpers' frames (batch-1 serving)
                fn(x.data_ptr(), w_ptr, b_ptr, None, out.data_ptr(), threads())
            return out

    run.spec, run.packed_weight, run.bias = spec, packed, bias_c  # keep the buffers alive
    if not pad:
        run.native = _native(spec, w_ptr, b_ptr, dtype, out_dtype, (("out",), ("threads",)),
                             lead=lead)
    return run


def _native(spec: GemmSpec, w_ptr: int, b_ptr: int | None, dtype, out_dtype, words: tuple,
            **rows) -> Native:
    """The kernel's call as a chain makes it: ``sym(x, w, bias, res, out, ...words)``."""
    res = ("in", 1) if spec.residual else ("word", None)
    widths, dtypes = ((spec.k, spec.n), (dtype, out_dtype)) if spec.residual else \
        ((spec.k,), (dtype,))
    return Native(get_kernel(spec), (("in", 0), ("word", w_ptr), ("word", b_ptr), res, *words),
                  widths, dtypes, spec.n, out_dtype, **rows)


def _generic_run(fn, spec, packed, bias_c, n: int, k: int, pad: bool, dtype, out_dtype):
    """The callable of a kernel generic over M: x of any leading dims (..., K), their product
    the row count, read per call; the output (..., N) keeps them. The common call (contiguous x
    of the kernel's dtype, no profiler) runs in this one frame, with no view around it."""
    w_ptr = packed.data_ptr()
    b_ptr = bias_c.data_ptr() if bias_c is not None else None
    symbol = spec.symbol
    empty, threads = torch.empty, torch.get_num_threads

    def prepare(x):
        if not (x.dim() == 2 and x.shape[1] == k and x.dtype == dtype and x.is_contiguous()):
            x = checked(x, (x.shape[0] if x.dim() == 2 else -1, k), "linear input", dtype)
        return F.pad(x, (0, 1)) if pad else x   # odd K: one zero column completes the last pair

    def rows_2d(x, res=None):
        """The checked path on (rows, K) x and (rows, N) residual: errors, odd K, profiler."""
        x = prepare(x)
        r_ptr = None
        if spec.residual:
            shape = (x.shape[0], n)
            if not (res.shape == shape and res.dtype == out_dtype and res.is_contiguous()):
                res = checked(res, shape, "linear residual", out_dtype)
            r_ptr = res.data_ptr()
        rows = x.shape[0]
        out = empty(rows, n, dtype=out_dtype)
        if rows == 0:
            return out
        if _profiler_enabled():
            with record_function(symbol):
                fn(x.data_ptr(), w_ptr, b_ptr, r_ptr, out.data_ptr(), rows, threads())
        else:
            fn(x.data_ptr(), w_ptr, b_ptr, r_ptr, out.data_ptr(), rows, threads())
        return out

    if spec.residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            if not (shape and shape[-1] == k and not pad and x.dtype == dtype and
                    x.is_contiguous() and res.dim() == len(shape) and res.shape[:-1] ==
                    shape[:-1] and res.shape[-1] == n and res.dtype == out_dtype and
                    res.is_contiguous()) or _profiler_enabled():
                return on_rows(rows_2d, x, res, n, True)
            out = empty(*shape[:-1], n, dtype=out_dtype)
            rows = x.numel() // k
            if rows:
                fn(x.data_ptr(), w_ptr, b_ptr, res.data_ptr(), out.data_ptr(), rows, threads())
            return out
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            if not (shape and shape[-1] == k and not pad and x.dtype == dtype and
                    x.is_contiguous()) or _profiler_enabled():
                return on_rows(rows_2d, x, None, n, False)
            out = empty(*shape[:-1], n, dtype=out_dtype)
            rows = x.numel() // k
            if rows:
                fn(x.data_ptr(), w_ptr, b_ptr, None, out.data_ptr(), rows, threads())
            return out

    run.spec, run.packed_weight, run.bias = spec, packed, bias_c  # keep the buffers alive
    if not pad:
        run.native = _native(spec, w_ptr, b_ptr, dtype, out_dtype,
                             (("out",), ("rows",), ("threads",)), max_rows=ANY_ROWS)
    return run
