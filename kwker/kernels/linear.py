"""``make_linear``: ``act(x @ W.T + bias) [+ residual]`` with W packed once, at build time."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import blocking
from ._call import _profiler_enabled, checked, entry, record_function, require_f32
from .specs import GemmSpec

EPILOGUES = ("none", "relu", "gelu", "gelu_tanh")


def pack_panels(w: torch.Tensor, nr: int) -> torch.Tensor:
    """(N, K) weights -> (ceil(N/nr), K, nr) k-major panels, zero-padded past column N."""
    n, k = w.shape
    panels = -(-n // nr)
    wt = F.pad(w.detach().to(torch.float32).t(), (0, panels * nr - n))  # (K, panels*nr)
    return wt.reshape(k, panels, nr).permute(1, 0, 2).contiguous()


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, m: int,
                epilogue: str = "none", residual: bool = False):
    """``callable(x (m, K)[, residual (m, N)]) -> (m, N)`` specialised to these shapes."""
    require_f32(weight, bias, what="make_linear")
    if epilogue not in EPILOGUES:
        raise ValueError(f"make_linear: epilogue must be one of {EPILOGUES}, not {epilogue!r}")
    if weight.dim() != 2:
        raise ValueError(f"make_linear: weight must be (N, K), got {tuple(weight.shape)}")
    n, k = weight.shape
    m = int(m)
    if min(m, n, k) < 1:
        raise ValueError(f"make_linear: empty shapes m={m}, N={n}, K={k}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"make_linear: bias must be ({n},), got {tuple(bias.shape)}")
    blk = blocking.choose(m, n, k)
    spec = GemmSpec(m, n, k, 1, "packed", bias is not None, epilogue, residual,
                    **blk.as_kwargs())
    fn = entry(spec, 5)
    packed = pack_panels(weight, blk.nr)
    bias_c = bias.detach().contiguous() if bias is not None else None
    w_ptr = packed.data_ptr()
    b_ptr = bias_c.data_ptr() if bias_c is not None else None
    symbol, x_shape, out_shape = spec.symbol, (m, k), (m, n)
    f32, empty, threads = torch.float32, torch.empty, torch.get_num_threads

    def call(x_ptr, r_ptr, o_ptr):
        if _profiler_enabled():
            with record_function(symbol):
                fn(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, threads())
        else:
            fn(x_ptr, w_ptr, b_ptr, r_ptr, o_ptr, threads())

    if residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            if not (x.shape == x_shape and x.dtype == f32 and x.is_contiguous()):
                x = checked(x, x_shape, "linear input")
            if not (res.shape == out_shape and res.dtype == f32 and res.is_contiguous()):
                res = checked(res, out_shape, "linear residual")
            out = empty(out_shape, dtype=f32)
            call(x.data_ptr(), res.data_ptr(), out.data_ptr())
            return out
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            if not (x.shape == x_shape and x.dtype == f32 and x.is_contiguous()):
                x = checked(x, x_shape, "linear input")
            out = empty(out_shape, dtype=f32)
            call(x.data_ptr(), None, out.data_ptr())
            return out

    run.spec, run.packed_weight, run.bias = spec, packed, bias_c  # keep the buffers alive
    return run
