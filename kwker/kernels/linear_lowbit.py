"""``make_linear_lowbit``: weight-only int8 / int4 linears from torchao's quantised weights.

torchao is not imported: its weight tensors are read by their documented fields (``qdata``,
``scale``, ``zero_point``, ``block_size``), so a model quantised by torchao runs on Kwker's
kernels without Kwker depending on torchao. Recognised (weight-only, activations unquantised):

- ``Int8Tensor`` (``Int8WeightOnlyConfig``): int8, per output channel or per group along K;
- ``IntxUnpackedToInt8Tensor`` (``IntxWeightOnlyConfig``): int1..int8 values held one per int8,
  per group or per axis, with zero points. Values of up to 4 bits are packed two per byte.

int8 values are read in place from torchao's own ``qdata`` (no copy). int4 values are repacked
once, at half the bytes of torchao's int8 copy, into the layout of codegen/gemm_lowbit.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..codegen import gemm_lowbit, simd
from ..runtime.target import host_target
from ._call import _profiler_enabled, checked, entry, kernel_dtype, record_function
from .linear import EPILOGUES
from .specs import LowbitGemmSpec

FORMATS = {"Int8Tensor", "IntxUnpackedToInt8Tensor"}
# W rows per block for a tile of this many x rows (mr * rr accumulators fit the registers)
ROWS_PER_BLOCK = {1: 8, 2: 6, 3: 4, 4: 3}
MAX_TILE_ROWS = 4


@dataclass(frozen=True)
class LowbitWeight:
    """A weight as ``(qdata - zero_point) * scale`` per group of ``group`` along K."""
    qdata: torch.Tensor              # (N, K) int8
    scale: torch.Tensor              # (N, K // group) float
    zero_point: torch.Tensor | None  # like scale, integer; None when every zero point is 0
    group: int
    bits: int                        # 8, or 4 for values that fit 4 bits
    dtype: torch.dtype               # what the tensor dequantises to (the model's dtype)
    source: str                      # class name, for messages


def is_quantized(t) -> bool:
    """Whether ``t`` is one of torchao's quantised weight tensors (supported or not)."""
    return isinstance(t, torch.Tensor) and type(t).__name__ in FORMATS and hasattr(t, "qdata")


def lowbit_weight(t: torch.Tensor) -> LowbitWeight:
    """The quantised weight behind a torchao tensor, or NotImplementedError saying why not."""
    name = type(t).__name__
    if not is_quantized(t):
        raise NotImplementedError(f"{name} is not a torchao weight Kwker reads ({FORMATS})")
    if getattr(t, "act_quant_kwargs", None) is not None or \
            getattr(t, "activation_quantization", None) is not None:
        raise NotImplementedError(f"{name} quantises activations too; Kwker lowers weight-only")
    if getattr(t, "act_pre_scale", None) is not None:
        raise NotImplementedError(f"{name} with an activation pre-scale (AWQ/SmoothQuant)")
    q, scale, zp = t.qdata, t.scale, getattr(t, "zero_point", None)
    block = tuple(t.block_size)
    if q.dtype != torch.int8 or q.dim() != 2 or len(block) != 2 or block[0] != 1:
        raise NotImplementedError(f"{name}: {q.dtype} qdata {tuple(q.shape)} in blocks {block}"
                                  " (Kwker takes int8 (N, K) in blocks of (1, group))")
    n, k = q.shape
    group = block[1]
    groups = -(-k // group)
    if k % group or tuple(scale.shape) not in ((n, groups), (n * groups,)):
        raise NotImplementedError(f"{name}: scale {tuple(scale.shape)} for {n}x{k} in groups "
                                  f"of {group}")
    scale = scale.reshape(n, groups)
    if zp is not None:
        if zp.is_floating_point() or zp.numel() != n * groups:
            raise NotImplementedError(f"{name}: zero points {zp.dtype} {tuple(zp.shape)} "
                                      "(Kwker takes integer zero points, one per group)")
        zp = zp.reshape(n, groups)
        if not bool(zp.any()):
            zp = None
        elif int(zp.min()) < -128 or int(zp.max()) > 127:
            raise NotImplementedError(f"{name}: zero points beyond int8")
    bits = 8
    target = getattr(t, "target_dtype", torch.int8)
    width = {getattr(torch, f"int{b}"): b for b in range(1, 9) if hasattr(torch, f"int{b}")}
    if width.get(target, 8) <= 4:
        bits = 4
    return LowbitWeight(q, scale, zp, group, bits, t.dtype, name)


def pack_int4(q: torch.Tensor, lanes: int, kp: int) -> torch.Tensor:
    """(N, K) int8 values in [-8, 7] -> (N, kp // 8) int32 words of nibbles ``q + 8``: per chunk
    of ``8 * lanes`` weights, weight ``j * lanes + l`` in nibble ``j`` of word ``l``; padding
    past K holds 8 (weight 0 before the zero point; the kernel's x padding is 0 anyway)."""
    n, k = q.shape
    if int(q.min()) < -8 or int(q.max()) > 7:
        raise NotImplementedError("int4 weights outside [-8, 7]")
    u = torch.full((n, kp), 8, dtype=torch.int32)
    u[:, :k] = q.to(torch.int32) + 8
    u = u.view(n, kp // (8 * lanes), 8, lanes)          # (row, chunk, nibble j, lane l)
    words = torch.zeros(n, kp // (8 * lanes), lanes, dtype=torch.int32)
    for j in range(8):
        words |= u[:, :, j, :] << (4 * j)
    return words.view(n, kp // 8)


def make_linear_lowbit(weight: torch.Tensor, bias: torch.Tensor | None, m: int | None = None,
                       epilogue: str = "none", residual: bool = False,
                       dtype: torch.dtype | None = None):
    """``callable(x (m, K)[, residual (m, N)]) -> (m, N)`` for a torchao quantised ``weight``.

    ``m=None``: any row count. ``dtype`` (default: the weight's) is the type of x, the residual
    and the output (float32 or bfloat16; sums, bias and epilogue in float32, one rounding)."""
    lw = lowbit_weight(weight)
    dtype = dtype or lw.dtype
    dt = kernel_dtype(dtype, "make_linear_lowbit")
    if epilogue not in EPILOGUES:
        raise ValueError(f"make_linear_lowbit: epilogue must be one of {EPILOGUES}")
    n, k = lw.qdata.shape
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"make_linear_lowbit: bias must be ({n},), got {tuple(bias.shape)}")
    lanes = simd.float_lanes(host_target())
    rows = min(m, MAX_TILE_ROWS) if m else 3
    spec = LowbitGemmSpec(m or 0, n, k, lw.bits, lw.group, lw.zero_point is not None,
                          bias is not None, epilogue, residual, dt, lanes, rows,
                          ROWS_PER_BLOCK[rows])
    try:
        gemm_lowbit._check(spec, lanes)
    except ValueError as e:
        raise NotImplementedError(str(e)) from None
    kp, groups = gemm_lowbit.padded_k(spec, lanes), gemm_lowbit.groups(spec, lanes)
    scale = torch.zeros(n, groups)
    scale[:, :lw.scale.shape[1]] = lw.scale.float()
    zp = None
    if lw.zero_point is not None:
        zp = torch.zeros(n, groups, dtype=torch.int8)
        zp[:, :lw.zero_point.shape[1]] = lw.zero_point
    if lw.bits == 8:
        w = lw.qdata if lw.qdata.is_contiguous() else lw.qdata.contiguous()
    else:
        w = pack_int4(lw.qdata, lanes, kp)
    bias_c = None
    if bias is not None:  # bf16: rounded as the model holds it, added in float32
        bias_c = bias.detach().to(dtype).float().contiguous()
    fn = entry(spec, 7, 1 if m else 2)
    ptrs = (w.data_ptr(), scale.data_ptr(), zp.data_ptr() if zp is not None else None,
            bias_c.data_ptr() if bias_c is not None else None)
    threads, empty, symbol = torch.get_num_threads, torch.empty, spec.symbol

    def prepare(x):
        if not (x.dim() == 2 and x.shape[1] == k and x.dtype == dtype and x.is_contiguous()):
            x = checked(x, (x.shape[0] if x.dim() == 2 else -1, k), "low-bit linear input",
                        dtype)
        if m is not None and x.shape[0] != m:
            raise ValueError(f"low-bit linear: built for {m} rows, got {tuple(x.shape)}")
        return x

    def call(x, r_ptr):
        out = empty(x.shape[0], n, dtype=dtype)
        if x.shape[0] == 0:
            return out
        args = (x.data_ptr(), *ptrs, r_ptr, out.data_ptr())
        if _profiler_enabled():
            with record_function(symbol):
                fn(*args, threads()) if m else fn(*args, x.shape[0], threads())
        else:
            fn(*args, threads()) if m else fn(*args, x.shape[0], threads())
        return out

    if residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            x = prepare(x)
            shape = (x.shape[0], n)
            if not (res.shape == shape and res.dtype == dtype and res.is_contiguous()):
                res = checked(res, shape, "low-bit linear residual", dtype)
            return call(x, res.data_ptr())
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            return call(prepare(x), None)

    # keep every buffer the kernel reads alive (int8: torchao's own qdata)
    run.spec, run.packed_weight, run.scale, run.zero_point, run.bias = spec, w, scale, zp, bias_c
    run.weight_bytes = w.numel() * w.element_size() + scale.numel() * 4 + \
        (zp.numel() if zp is not None else 0)
    return run


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """torchao's float32 dequantised weight, ``(q - zp) * scale`` (the accuracy reference)."""
    lw = lowbit_weight(weight)
    q = lw.qdata.float().view(lw.qdata.shape[0], -1, lw.group)
    if lw.zero_point is not None:
        q = q - lw.zero_point.float().unsqueeze(-1)
    return (q * lw.scale.float().unsqueeze(-1)).view(lw.qdata.shape)


__all__ = ["LowbitWeight", "dequantized", "is_quantized", "lowbit_weight", "make_linear_lowbit",
           "pack_int4"]
