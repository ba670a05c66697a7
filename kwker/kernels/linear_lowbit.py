"""``make_linear_lowbit``: weight-only int8 / int4 linears from torchao's quantised weights.

torchao is not imported: its weight tensors are read by their documented fields (``qdata``,
``scale``, ``zero_point``, ``block_size``), so a model quantised by torchao runs on Kwker's
kernels without Kwker depending on torchao. Recognised (weight-only, activations unquantised):

- ``Int8Tensor`` (``Int8WeightOnlyConfig``): int8, per output channel or per group along K;
- ``IntxUnpackedToInt8Tensor`` (``IntxWeightOnlyConfig``): int1..int8 values held one per int8,
  per group or per axis, with zero points. Values of up to 4 bits are packed two per byte.

``LowbitTensor`` holds the same fields without torchao: a package's quantised weights, loaded in
a process that may not have torchao.

int8 values are read in place from torchao's own ``qdata`` (no copy). int4 values are repacked
once, at half the bytes of torchao's int8 copy, into the layout of codegen/gemm_lowbit.py.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import torch

from ..codegen import gemm_lowbit, gemm_lowbit_fold, gemm_lowbit_vnni4, simd
from ..runtime import huge_pages
from ..runtime.kernel import get_kernel
from ..runtime.target import host_target
from . import lowbit_stream, variants
from ._call import (
    Native,
    _profiler_enabled,
    checked,
    entry,
    kernel_dtype,
    on_rows,
    record_function,
)
from .linear import EPILOGUES
from .linear_lowbit_prefill import Buffers, gemv_run, prefill_run
from .specs import (
    Int4PackSpec,
    LowbitGemmSpec,
)

FORMATS = {"Int8Tensor", "IntxUnpackedToInt8Tensor", "LowbitTensor"}
# W rows per block for a tile of this many x rows (mr * rr accumulators fit the registers)
ROWS_PER_BLOCK = {1: 8, 2: 6, 3: 4, 4: 3}
MAX_TILE_ROWS = 4
# from this many rows the weights are dequantised per call as the GEMM family's kernel packs them
# (its FLOPs then outweigh one pass over the weights): see make_linear_lowbit
PREFILL_ROWS = 16


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
    version: int | None = None       # the tensor's: bumped by an in-place copy_ (torchao
    # copies into qdata without bumping qdata's own)


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
    try:
        version = t._version
    except RuntimeError:  # an inference tensor has no version counter
        version = None
    return LowbitWeight(q, scale, zp, group, bits, t.dtype, name, version)


class LowbitTensor(torch.Tensor):
    """A weight-only quantised weight of Kwker's own: torchao's fields (``qdata``, ``scale``,
    ``zero_point``, ``block_size``, ``target_dtype``), read back from a package without torchao.
    It stands for the dequantised (N, K) weight of its ``dtype``: an op that is not lowered to
    a low-bit kernel sees that dense weight, as torchao's tensors make it."""

    @staticmethod
    def __new__(cls, qdata, scale, zero_point, group: int, bits: int, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype,
                                                   device=qdata.device)

    def __init__(self, qdata, scale, zero_point, group: int, bits: int, dtype: torch.dtype):
        self.qdata, self.scale, self.zero_point = qdata, scale, zero_point
        self.block_size, self.bits = (1, group), bits
        self.target_dtype = torch.int8 if bits == 8 else getattr(torch, f"int{bits}")

    def __repr__(self):
        return (f"LowbitTensor(int{self.bits}, {tuple(self.shape)}, groups of "
                f"{self.block_size[1]}, {self.dtype})")

    def __tensor_flatten__(self):
        names = ["qdata", "scale"] + (["zero_point"] if self.zero_point is not None else [])
        return names, {"group": self.block_size[1], "bits": self.bits, "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return LowbitTensor(inner["qdata"], inner["scale"], inner.get("zero_point"),
                            ctx["group"], ctx["bits"], ctx["dtype"])

    def dequantize(self) -> torch.Tensor:
        return dequantized(self).to(self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def dense(t):
            return t.dequantize() if isinstance(t, LowbitTensor) else t
        return func(*tree_map(dense, args), **tree_map(dense, kwargs or {}))


def pack_int4(q: torch.Tensor, lanes: int, kp: int, rr: int) -> torch.Tensor:
    """(N, K) int8 values in [-8, 7] -> int32 words of nibbles ``q + 8`` in the layout of
    codegen/gemm_lowbit.py: per chunk of ``8 * lanes`` weights, weight ``j * lanes + l`` in
    nibble ``j`` of word ``l``; blocks of ``rr`` rows with their chunks interleaved. Padding past
    K and past N holds 8 (weight 0 before the zero point; the kernel's x padding is 0 anyway,
    and padded rows are never stored). A kernel of its own (codegen/int4_pack.py): built a byte
    at a time in torch it took 2.5 s for 512 MB of packed weights (Xeon with AMX, 2 threads),
    paid by every process that loads an int4 model."""
    n, k = q.shape
    if q.numel():
        lo, hi = torch.aminmax(q)
        if int(lo) < -8 or int(hi) > 7:
            raise NotImplementedError("int4 weights outside [-8, 7]")
    if q.stride(1) != 1:
        q = q.contiguous()
    rows, chunks = -(-n // rr) * rr, kp // (8 * lanes)
    out = huge_pages.empty((rows // rr, chunks, rr, lanes), torch.int32)   # streamed per token
    if rows:
        entry(Int4PackSpec(k, kp, rr, lanes), 2, 3)(q.data_ptr(), out.data_ptr(), q.stride(0), n,
                                                    torch.get_num_threads())
    return out.view(rows, chunks * lanes)


def make_linear_lowbit(weight: torch.Tensor, bias: torch.Tensor | None, m: int | None = None,
                       epilogue: str = "none", residual: bool = False,
                       dtype: torch.dtype | None = None, lead: tuple | None = None,
                       ahead: int | None = None):
    """``callable(x (m, K)[, residual (m, N)]) -> (m, N)`` for a torchao quantised ``weight``.

    ``m=None``: any row count, x of any leading dims (``(..., K) -> (..., N)``). ``dtype``
    (default: the weight's) is the type of x, the residual and the output (float32 or
    bfloat16; sums, bias and epilogue in float32, one rounding).
    ``lead``: the leading dims of x, the residual and the output in place of ``(m,)`` (their
    product ``m``), e.g. a decoder's (1, 1, K) token taken as it is. ``ahead``: bytes the
    decode kernel prefetches its weight stream ahead, 0 for none (default: as measured on this
    machine, ``lowbit_stream``); given, the kernel is built on the default path, nothing timed
    (that measurement's own kernels)."""
    lead = tuple(int(d) for d in lead) if lead else None if m is None else (m,)
    if lead is not None and (m is None or math.prod(lead) != m):
        raise ValueError(f"make_linear_lowbit: leading dims {lead} for m={m}")
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
    group = lw.group
    if lw.bits == 4 and group >= k:  # one group a row: it spans the row's padding too
        group = -(-k // gemm_lowbit.chunk(4, lanes)) * gemm_lowbit.chunk(4, lanes)
    # int4 is packed once for every row count (blocks of 8 / 4 rows gave decode and the generic
    # kernels two copies): blocks of 8 rows (gemm_lowbit.tile_rows), or on AVX2 (folded tiles),
    # which takes one W row at a time, blocks of one row, read in order
    folded = gemm_lowbit_fold.folds(lw.bits, lanes)
    block = 1 if folded else ROWS_PER_BLOCK[1 if lw.bits == 4 else rows]
    pinned = ahead is not None
    if not pinned:
        ahead = lowbit_stream.ahead(lw.bits, _stream_probe)
    spec = LowbitGemmSpec(m or 0, n, k, lw.bits, group, lw.zero_point is not None,
                          bias is not None, epilogue, residual, dt, lanes, rows, block,
                          ahead=ahead)
    args = (spec, lw, bias, m, dtype, lead, lanes, folded)
    vnni = _vnni(spec, lanes) and (lw.bits == 8 or _digit_sums_fit(lw))
    if not vnni or lw.bits == 8 or pinned:
        return _build(*args, vnni)
    # int4 for a lone x row: vpdpbusd or the float path's lookups, measured (Emerald Rapids:
    # vpdpbusd 1.3-1.45x; their rates differ by CPU), the weights packed once for both
    shape = lead or (1,)    # the generic kernel timed on one row

    def inputs():
        x = torch.randn(*shape, k, dtype=dtype)
        return [x, torch.randn(*shape, n, dtype=dtype)] if residual else [x]
    problem = {"inputs": [["tensor", [*shape, k], None, str(dtype)]], "n": n, "k": k,
               "group": group, "zero_point": spec.zero_point, "rows": m or 0,
               "bias": bias is not None, "epilogue": epilogue, "residual": residual}
    return variants.pick("low-bit decode", problem, {
        "vpdpbusd": lambda: _build(*args, True), "float": lambda: _build(*args, False)},
        inputs)[1]


def _stream_probe(q: torch.Tensor, scale: torch.Tensor, bits: int, ahead: int):
    """The decode callable of a synthetic weight (``lowbit_stream``'s measurement)."""
    weight = LowbitTensor(q, scale, None, q.shape[1], bits, torch.float32)
    return make_linear_lowbit(weight, None, m=1, ahead=ahead)


def _build(spec: LowbitGemmSpec, lw: LowbitWeight, bias, m: int | None, dtype, lead, lanes: int,
           folded: bool, vnni: bool):
    """``make_linear_lowbit``'s callable for ``spec``, on ``vpdpbusd`` if ``vnni``."""
    n, k, residual = spec.n, spec.k, spec.residual
    if vnni:  # int8: one x row at a time; int4: a lone one (decode)
        spec = replace(spec, vnni=True, mr=1, rr=ROWS_PER_BLOCK[1]) if spec.bits == 8 else \
            replace(spec, vnni=True, digits=2 if spec.dtype == "bf16" else 3)
    elif m is not None and m >= PREFILL_ROWS:  # no decode tile: int4 packed as decode packs it
        spec = replace(spec, mr=1, rr=1 if folded else ROWS_PER_BLOCK[1])
    try:
        gemm_lowbit._check(spec, lanes)
    except ValueError as e:
        raise NotImplementedError(str(e)) from None
    kp, groups = gemm_lowbit.padded_k(spec, lanes), gemm_lowbit.groups(spec, lanes)
    w, scale, zp = _operands(lw, lanes, kp, spec.rr, groups)
    bias_c = None
    if bias is not None:  # bf16: rounded as the model holds it, added in float32
        bias_c = bias.detach().to(dtype).float().contiguous()
    if spec.vnni and spec.bits == 8:  # the row sums of q, in the zero points' place
        zp = _row_sums(lw.qdata)
    buffers = Buffers(w, scale, zp, bias_c)
    if m is not None and m < PREFILL_ROWS:
        return _decode_run(spec, buffers, dtype, lead)
    prefill, specs = prefill_run(spec, buffers, dtype, m)
    if m is not None:
        return _leading(_wrap(prefill, specs, buffers, n, k, m, residual, dtype), lead, k, n,
                        residual)
    gemv = gemv_run(spec, buffers, dtype)

    def either(x, r):
        return (gemv if x.shape[0] < PREFILL_ROWS else prefill)(x, r)
    return _any_rows(spec, buffers, dtype,
                     _wrap(either, [spec] + specs, buffers, n, k, m, residual, dtype))


# (id(qdata), lanes, padded K, rr, groups) -> (weakref to qdata, the versions of its tensors,
# (w, scale, zp)): the kernels of one weight (a model's prefill, decode and recompiled graphs)
# share its repacked operands, repacked when the weight was changed in place
_OPERANDS: dict = {}


def _operands(lw: LowbitWeight, lanes: int, kp: int, rr: int, groups: int) -> tuple:
    """(values, scales, zero points) as the kernels read them: int8 values in place (their
    storage moved onto huge pages, ``huge_pages.move``), int4 ones repacked, scales and zero
    points padded to whole groups. Made once per weight and layout
    while the weight lives (GPT-2 int4: three compiled graphs held three packed copies, 160
    MB)."""
    q = lw.qdata
    if lw.bits == 8:   # read in place, each token: moved onto huge pages (a copy would double)
        huge_pages.move(q)
    key = (id(q), lanes, kp, rr, groups)
    versions = (lw.version, *(t._version for t in (q, lw.scale, lw.zero_point) if t is not None))
    hit = _OPERANDS.get(key)
    if hit is not None and hit[0]() is q and hit[1] == versions:
        return hit[2]
    n = q.shape[0]
    # int8 values are q itself: cached, they would keep q alive, so only int4 is kept here
    scale = huge_pages.empty((n, groups), torch.float32).zero_()   # streamed with the weights
    scale[:, :lw.scale.shape[1]] = lw.scale.float()
    zp = None
    if lw.zero_point is not None:
        zp = huge_pages.empty((n, groups), torch.int8).zero_()
        zp[:, :lw.zero_point.shape[1]] = lw.zero_point
    if lw.bits == 8:
        return (q if q.is_contiguous() else q.contiguous()), scale, zp
    w = pack_int4(q, lanes, kp, rr)
    if hit is None:
        weakref.finalize(q, _OPERANDS.pop, key, None)
    _OPERANDS[key] = (weakref.ref(q), versions, (w, scale, zp))
    return w, scale, zp


def _row_sums(q: torch.Tensor) -> torch.Tensor:
    """``q.sum(1)`` as int32, a few rows at a time: the whole sum widens q to an int32 copy
    first (4 bytes a weight), which the allocator kept resident (GPT-2 int8: 9 MB a linear)."""
    rows = max(1, (64 << 10) // (4 * q.shape[1]))
    return torch.cat([q[i:i + rows].sum(1, dtype=torch.int32) for i in range(0, q.shape[0], rows)])


def _vnni(spec: LowbitGemmSpec, lanes: int) -> bool:
    """Whether the decode kernel takes its weights on ``vpdpbusd`` (where the CPU has
    AVX512_VNNI): int8 per channel (3/64 of an instruction a weight instead of 3/16) and
    int4 for a lone x row (16/128 instead of ~28/128; several rows share each
    weight's lookup on the float path's tiles, as fast there)."""
    return host_target().has("avx512vnni") and gemm_lowbit_vnni4.either_usable(spec, lanes)


def _digit_sums_fit(lw: LowbitWeight) -> bool:
    """Whether int4 on vpdpbusd sums exactly in int32: ``|q - zp| <= 63`` (8 products of x's
    22-bit integers a word, gemm_lowbit_vnni4.py), so zero points in [-56, 55]."""
    zp = lw.zero_point
    return zp is None or zp.numel() == 0 or (int(zp.min()) >= -56 and int(zp.max()) <= 55)


def _leading(run, lead: tuple, k: int, n: int, residual: bool):
    """``run`` (on (m, K) rows) taking and giving tensors of leading dims ``lead``."""
    m = math.prod(lead)
    if lead == (m,):
        return run

    def rows(x, width, name):
        if tuple(x.shape) != (*lead, width):
            raise ValueError(f"low-bit linear {name}: expected shape {(*lead, width)}, got "
                             f"{tuple(x.shape)}")
        return x.reshape(m, width)
    if residual:
        def shaped(x, r):
            return run(rows(x, k, "input"), rows(r, n, "residual")).view(*lead, n)
    else:
        def shaped(x):
            return run(rows(x, k, "input")).view(*lead, n)
    shaped.__dict__.update(run.__dict__)
    return shaped


def _any_rows(spec: LowbitGemmSpec, buf: Buffers, dtype, checked_run):
    """The factory's callable for any row count: x of any leading dims (``(..., K) -> (...,
    N)``, as ``F.linear``). Decode-sized rows of contiguous x go to the decode kernel in this one
    frame, with no view around it; the rest through ``checked_run`` (checks, the prefill
    schedules, the profiler) on (rows, K) views. Each frame and view a token's ~50 calls
    shed counts several times its warm price after the weights have emptied the caches."""
    fn = entry(spec, 7, 2)
    w_p, s_p, z_p, b_p = buf.ptrs()
    n, k = spec.n, spec.k
    empty, threads = torch.empty, torch.get_num_threads

    if spec.residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            if shape and shape[-1] == k and x.dtype == dtype and x.is_contiguous() and \
                    res.dim() == len(shape) and res.shape[:-1] == shape[:-1] and \
                    res.shape[-1] == n and res.dtype == dtype and res.is_contiguous() and \
                    not _profiler_enabled():
                rows = x.numel() // k
                if 0 < rows < PREFILL_ROWS:
                    out = empty(*shape[:-1], n, dtype=dtype)
                    fn(x.data_ptr(), w_p, s_p, z_p, b_p, res.data_ptr(), out.data_ptr(), rows,
                       threads())
                    return out
            return on_rows(checked_run, x, res, n, True)
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            if shape and shape[-1] == k and x.dtype == dtype and x.is_contiguous() and \
                    not _profiler_enabled():
                rows = x.numel() // k
                if 0 < rows < PREFILL_ROWS:
                    out = empty(*shape[:-1], n, dtype=dtype)
                    fn(x.data_ptr(), w_p, s_p, z_p, b_p, None, out.data_ptr(), rows, threads())
                    return out
            return on_rows(checked_run, x, None, n, False)

    run.specs, run.buffers, run.weight_bytes = checked_run.specs, buf, buf.nbytes
    run.native = _native(spec, buf, dtype, words=(("out",), ("rows",), ("threads",)),
                         max_rows=PREFILL_ROWS - 1)
    return run


def _native(spec: LowbitGemmSpec, buf: Buffers, dtype, words: tuple, **rows) -> Native:
    """The decode kernel's call as a chain makes it: ``sym(x, w, scale, zp, bias, res, out,
    ...words)``."""
    res = ("in", 1) if spec.residual else ("word", None)
    widths = (spec.k, spec.n) if spec.residual else (spec.k,)
    return Native(get_kernel(spec), (("in", 0), *(("word", p) for p in buf.ptrs()), res, *words),
                  widths, (dtype,) * len(widths), spec.n, dtype, **rows)


def _decode_run(spec: LowbitGemmSpec, buf: Buffers, dtype, lead: tuple):
    """The factory's callable for a fixed decode row count: ``_wrap(gemv_run(...))`` without their
    frames in the common call (x and residual as the kernel takes them, no profiler). A token
    runs ~50 of these after its weights have evicted the caches, where each frame and
    ``torch.empty`` costs several times its warm price."""
    fn = entry(spec, 7, 1)
    w_p, s_p, z_p, b_p = buf.ptrs()
    n, k, m = spec.n, spec.k, spec.m
    x_shape, out_shape = (*lead, k), (*lead, n)
    template, empty_like, threads = torch.empty(out_shape, dtype=dtype), torch.empty_like, \
        torch.get_num_threads
    slow = _leading(_wrap(gemv_run(spec, buf, dtype), [spec], buf, n, k, m, spec.residual, dtype),
                    lead, k, n, spec.residual)

    if spec.residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            if not (x.shape == x_shape and x.dtype == dtype and x.is_contiguous() and
                    res.shape == out_shape and res.dtype == dtype and res.is_contiguous()) \
                    or _profiler_enabled():
                return slow(x, res)
            out = empty_like(template)
            fn(x.data_ptr(), w_p, s_p, z_p, b_p, res.data_ptr(), out.data_ptr(), threads())
            return out
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            if not (x.shape == x_shape and x.dtype == dtype and x.is_contiguous()) \
                    or _profiler_enabled():
                return slow(x)
            out = empty_like(template)
            fn(x.data_ptr(), w_p, s_p, z_p, b_p, None, out.data_ptr(), threads())
            return out

    run.specs, run.buffers, run.weight_bytes = slow.specs, buf, buf.nbytes
    run.native = _native(spec, buf, dtype, words=(("out",), ("threads",)), lead=lead)
    return run


def _wrap(call, specs: list, buf: Buffers, n: int, k: int, m: int | None, residual: bool,
          dtype):
    """The factory's callable around ``call(x, residual)``: input checks, profiler."""
    symbol = specs[0].symbol

    def prepare(x):
        if not (x.dim() == 2 and x.shape[1] == k and x.dtype == dtype and x.is_contiguous()):
            x = checked(x, (x.shape[0] if x.dim() == 2 else -1, k), "low-bit linear input",
                        dtype)
        if m is not None and x.shape[0] != m:
            raise ValueError(f"low-bit linear: built for {m} rows, got {tuple(x.shape)}")
        return x

    def profiled(x, r):
        if _profiler_enabled():
            with record_function(symbol):
                return call(x, r)
        return call(x, r)

    if residual:
        def run(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
            x = prepare(x)
            shape = (x.shape[0], n)
            if not (res.shape == shape and res.dtype == dtype and res.is_contiguous()):
                res = checked(res, shape, "low-bit linear residual", dtype)
            return profiled(x, res)
    else:
        def run(x: torch.Tensor) -> torch.Tensor:
            return profiled(prepare(x), None)

    run.specs, run.buffers, run.weight_bytes = specs, buf, buf.nbytes
    return run


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """torchao's float32 dequantised weight, ``(q - zp) * scale`` (the accuracy reference)."""
    lw = lowbit_weight(weight)
    q = lw.qdata.float().view(lw.qdata.shape[0], -1, lw.group)
    if lw.zero_point is not None:
        q = q - lw.zero_point.float().unsqueeze(-1)
    return (q * lw.scale.float().unsqueeze(-1)).view(lw.qdata.shape)


__all__ = ["LowbitTensor", "LowbitWeight", "dequantized", "is_quantized", "lowbit_weight",
           "make_linear_lowbit", "pack_int4"]
