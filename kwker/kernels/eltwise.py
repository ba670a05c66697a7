"""Factories for elementwise kernels (GELU in both forms), float32 or bfloat16."""
from __future__ import annotations

import torch

from ..runtime.calling import row_stride
from ..runtime.kernel import get_kernel
from ._call import ANY_ROWS, Native, _profiler_enabled, checked, entry, record_function
from .specs import EltwiseSpec

_GELU_OPS = {"none": "gelu", "tanh": "gelu_tanh"}
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def _checked(x: torch.Tensor, numel: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``x`` flat, contiguous and of ``dtype``, or a useful error (slow path only)."""
    if dtype == torch.float32:
        return checked(x.reshape(-1), (numel,), name)
    if x.dtype != dtype:
        raise NotImplementedError(f"{name}: {dtype} kernel, got {x.dtype}")
    if x.numel() != numel:
        raise ValueError(f"{name}: expected {numel} elements, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"{name}: CPU tensors only, got {x.device}")
    return x.reshape(-1).contiguous()


def make_eltwise(op: str, numel: int | None, dtype: torch.dtype = torch.float32):
    """``callable(x) -> op(x)`` for contiguous ``x`` of ``dtype`` (float32 or bfloat16) with
    ``numel`` elements, or of any size with ``numel=None`` (one kernel for every shape, the size
    passed per call). bf16 is computed in float32 and rounded once, as ATen does."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"kwker {op}: float32 or bfloat16 only, got {dtype}")
    if numel is not None and int(numel) < 1:
        raise ValueError(f"kwker {op}: numel must be >= 1 or None (any size), got {numel}")
    spec = EltwiseSpec(op, int(numel or 0), _DTYPES[dtype])
    fn = entry(spec, 2, 1 if numel else 2)
    symbol, name = spec.symbol, f"kwker {op}"
    get_threads, empty_like = torch.get_num_threads, torch.empty_like

    if numel is None:
        def run(x: torch.Tensor) -> torch.Tensor:
            if not (x.dtype == dtype and x.is_contiguous()):
                x = _checked(x, x.numel(), dtype, name).view(x.shape)
            out = empty_like(x)
            args = (x.data_ptr(), out.data_ptr(), x.numel(), get_threads())
            if _profiler_enabled():
                with record_function(symbol):
                    fn(*args)
            else:
                fn(*args)
            return out
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            if not (x.numel() == numel and x.dtype == dtype and x.is_contiguous()):
                x = _checked(x, numel, dtype, name).view(x.shape)
            out = empty_like(x)
            if _profiler_enabled():
                with record_function(symbol):
                    fn(x.data_ptr(), out.data_ptr(), get_threads())
            else:
                fn(x.data_ptr(), out.data_ptr(), get_threads())
            return out

    run.spec = spec
    return run


def make_gelu(numel: int | None, approximate: str = "none", dtype: torch.dtype = torch.float32):
    """GELU over ``numel`` (None: any number of) contiguous float32 or bfloat16: exact erf form
    or ``approximate="tanh"``."""
    if approximate not in _GELU_OPS:
        raise ValueError(f"GELU approximate must be 'none' or 'tanh', not {approximate!r}")
    return make_eltwise(_GELU_OPS[approximate], numel, dtype)


def make_silu_mul(numel: int | None, dtype: torch.dtype = torch.float32,
                  width: int | None = None):
    """``callable(x, y) -> F.silu(x) * y`` (SwiGLU's gate) for contiguous ``x`` and ``y`` of one
    shape and ``dtype``; ``numel=None``: any size. bf16 rounds the SiLU before the product, as
    eager runs the two ops. The callable has a native form (``_call.Native``, for chains) on
    rows: of ``width`` (their last dim) with ``numel``, of any width without."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"kwker silu_mul: float32 or bfloat16 only, got {dtype}")
    if numel is not None and int(numel) < 1:
        raise ValueError(f"kwker silu_mul: numel must be >= 1 or None (any size), got {numel}")
    spec = EltwiseSpec("silu_mul", int(numel or 0), _DTYPES[dtype])
    fn = entry(spec, 3, 1 if numel else 2)
    symbol, name = spec.symbol, "kwker silu_mul"
    get_threads, empty_like = torch.get_num_threads, torch.empty_like

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = x.numel() if numel is None else numel
        if not (x.numel() == n and x.dtype == dtype and x.is_contiguous()):
            x = _checked(x, n, dtype, name).view(x.shape)
        if not (y.shape == x.shape and y.dtype == dtype and y.is_contiguous()):
            if y.shape != x.shape:
                raise ValueError(f"{name}: y {tuple(y.shape)} is not x's shape "
                                 f"{tuple(x.shape)}")
            y = _checked(y, n, dtype, name).view(y.shape)
        out = empty_like(x)
        if n == 0:
            return out
        args = (x.data_ptr(), y.data_ptr(), out.data_ptr()) + (() if numel else (n,))
        if _profiler_enabled():
            with record_function(symbol):
                fn(*args, get_threads())
        else:
            fn(*args, get_threads())
        return out

    run.spec = spec
    if not numel:   # rows of whatever width its inputs' producers give (kernels/chain.py)
        run.native = Native(get_kernel(spec), (("in", 0), ("in", 1), ("out",), ("numel",),
                                               ("threads",)),
                            (0, 0), (dtype, dtype), 0, dtype, max_rows=ANY_ROWS)
    elif width and numel % width == 0:
        run.native = Native(get_kernel(spec), (("in", 0), ("in", 1), ("out",), ("threads",)),
                            (width, width), (dtype, dtype), width, dtype, rows=numel // width)
    return run


def make_silu_mul_rows(dtype: torch.dtype = torch.float32):
    """``callable(x, y) -> F.silu(x) * y`` for x and y of one shape whose rows (the last dim)
    are contiguous but may lie apart, such as the two halves of ``t.chunk(2, -1)`` (a fused gate
    and up projection); the result is contiguous, as ATen's is. Inputs that are not rows of a
    stride fall back to ATen. One kernel for every size."""
    if dtype not in _DTYPES:
        raise NotImplementedError(f"kwker silu_mul: float32 or bfloat16 only, got {dtype}")
    spec = EltwiseSpec("silu_mul", 0, _DTYPES[dtype], rows=True)
    fn = entry(spec, 3, 5)
    symbol, silu = spec.symbol, torch.nn.functional.silu
    get_threads, empty_like = torch.get_num_threads, torch.empty_like
    contiguous = torch.contiguous_format
    layouts = {}  # (shape, strides of x and y) -> (rows, width, ldx, ldy), or None: ATen's

    def rows_of(t: torch.Tensor):
        """(rows, width, row stride) of ``t`` as rows, or None."""
        if t.dim() == 0 or t.stride(-1) != 1 and t.shape[-1] > 1:
            return None
        ld = row_stride(t.shape, t.stride(), t.dim() - 1)
        width = t.shape[-1]
        return None if ld is None else (t.numel() // width if width else 0, width, ld)

    def run(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if not (y.shape == shape and x.dtype == dtype and y.dtype == dtype and x.is_cpu and
                y.is_cpu):
            return silu(x) * y
        if shape and x.is_contiguous() and y.is_contiguous():
            # the common case in one frame (separate gate and up projections: a Llama decode
            # step's 12 calls at 3 us where the stride checks took 8)
            width = ldx = ldy = shape[-1]
            rows = x.numel() // width if width else 0
            out = empty_like(x)   # 0.7 us; torch.empty(shape, dtype=...) takes 1.9
        else:
            key = (shape, x.stride(), y.stride())
            layout = layouts.get(key, False)
            if layout is False:   # a graph's layouts repeat: checked once each
                fx, fy = rows_of(x), rows_of(y)
                layout = None if fx is None or fy is None else (*fx, fy[2])
                if len(layouts) < 64:
                    layouts[key] = layout
            if layout is None:
                return silu(x) * y
            rows, width, ldx, ldy = layout
            out = empty_like(x, memory_format=contiguous)
        if rows * width == 0:
            return out
        args = (x.data_ptr(), y.data_ptr(), out.data_ptr(), rows, width, ldx, ldy)
        if _profiler_enabled():
            with record_function(symbol):
                fn(*args, get_threads())
        else:
            fn(*args, get_threads())
        return out

    run.spec = spec
    # the contiguous call, on rows of whatever width its inputs' producers give (kernels/chain.py)
    run.native = Native(get_kernel(spec), (("in", 0), ("in", 1), ("out",), ("rows",),
                                           ("width",), ("width",), ("width",), ("threads",)),
                        (0, 0), (dtype, dtype), 0, dtype, max_rows=ANY_ROWS)
    return run
