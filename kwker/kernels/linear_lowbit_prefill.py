"""The many-row (prefill) side of ``make_linear_lowbit``, and the buffers and decode call it
shares with the factory (kernels/linear_lowbit.py).

Two schedules, picked by ``prefill_run``: x's byte planes on the u8s8 GEMM (float32 x with int8
weights per channel or int4 in groups of 32 k, where the CPU has an int8 GEMM); and the
GEMM family's kernel, on the vector path or on bf16 tiles (AMX), with the weights dequantised
panel by panel as its driver packs them (``GemmSpec.b_bits``: no float copy of the weights).
Where the user allows float32 products below full precision (torch's float32 matmul precision,
read per call), the planes drop to two and float32 x may take the bf16 products
(``_bf16_where_allowed``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ..codegen import gemm_lowbit, gemm_lowbit_planes, gemm_lowbit_vnni, gemm_tile_grouped
from ..runtime.target import host_target
from . import blocking
from ._call import entry, float32_precision, follow_precision
from .specs import (
    GemmSpec,
    LowbitGemmSpec,
    LowbitPanelsSpec,
    LowbitPlanesSpec,
)

# the byte planes' prefill packs the weights' panels whole up to this many bytes, else in blocks
# of W rows of PREFILL_BLOCK bytes
PREFILL_WHOLE, PREFILL_BLOCK = 16 << 20, 2 << 20


@dataclass
class Buffers:
    """What the kernels read besides x: the weights (int8: torchao's qdata), scales, zero
    points and bias; held by the callable for as long as it lives."""
    w: torch.Tensor
    scale: torch.Tensor
    zp: torch.Tensor | None          # zero points; with ``spec.vnni``, the row sums of q
    bias: torch.Tensor | None

    def ptrs(self) -> tuple:
        return (self.w.data_ptr(), self.scale.data_ptr(),
                self.zp.data_ptr() if self.zp is not None else None,
                self.bias.data_ptr() if self.bias is not None else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w, self.scale, self.zp)
                   if t is not None)


def gemv_run(spec: LowbitGemmSpec, buf: Buffers, dtype):
    """``call(x, residual) -> out`` on the decode kernel (weights streamed once)."""
    fn = entry(spec, 7, 2 if spec.m == 0 else 1)
    w_p, s_p, z_p, b_p = buf.ptrs()
    n, threads, empty = spec.n, torch.get_num_threads, torch.empty

    def call(x, r):
        out = empty(x.shape[0], n, dtype=dtype)
        r_ptr = None if r is None else r.data_ptr()
        if spec.m:
            fn(x.data_ptr(), w_p, s_p, z_p, b_p, r_ptr, out.data_ptr(), threads())
        elif x.shape[0]:
            fn(x.data_ptr(), w_p, s_p, z_p, b_p, r_ptr, out.data_ptr(), x.shape[0], threads())
        return out
    return call


def prefill_run(spec: LowbitGemmSpec, buf: Buffers, dtype, m: int | None) -> tuple:
    """``(call(x, residual) -> out, specs)`` for many rows, on the best schedule this CPU has
    (module doc)."""
    if _planes(spec):
        planes = _prefill_planes(spec, buf, dtype, m)
        # where bf16 products are allowed, int8 takes two planes; int4 the bf16 products
        return planes if spec.bits == 8 else _bf16_where_allowed(planes, spec, buf, m)
    exact = _prefill_fused(spec, buf, dtype, m)
    return _bf16_where_allowed(exact, spec, buf, m) if spec.dtype == "f32" else exact


def _bf16_where_allowed(exact: tuple, spec: LowbitGemmSpec, buf: Buffers, m: int | None):
    """``exact``'s ``(call, specs)``, its call taking bf16 products for float32 x where the user
    allows them (``float32_precision() == "bf16"``, read per call) and the CPU has fast ones
    (``vdpbf16ps`` or bf16 tiles): x and the dequantised weights rounded to bf16, as eager's
    oneDNN rounds them; sums, bias, residual and output in float32. Built on first need."""
    if not blocking.fast_bf16():
        return exact
    call, specs = exact
    half = replace(spec, dtype="bf16")

    def on_bf16():
        fn = _prefill_fused(half, buf, torch.float32, m, out="f32")[0]
        return lambda x, r: fn(x.to(torch.bfloat16), r)
    return follow_precision(("bf16",), on_bf16, lambda: call), specs


def _planes(spec: LowbitGemmSpec) -> bool:
    """Whether many rows go by x's byte planes on the u8s8 GEMM (codegen/gemm_lowbit_planes.py),
    for float32 x:

    - int8 weights the vpdpbusd decode takes, where the CPU has an int8 GEMM
      (``blocking.int8_blocking``: AMX-INT8 or emulated tiles, else AVX-512 VNNI). Against the
      float32 GEMM of dequantised weights, 128 rows, 2 threads: on Emerald Rapids's tiles 2304
      x 768 2.04 -> 0.77 ms, 768 x 3072 2.71 -> 1.40, GPT-2's head 49.9 -> 17.2; on Zen 5's
      vpdpbusd against the panel-by-panel float path, GPT-2's linears 1.04-1.29x.
    - int4 weights in groups of whole 32 k, against the float32 GEMM of dequantised panels: on
      vpdpbusd (AVX-512 VNNI; Zen 5, 128 rows, 2 threads, groups of 32, best of 3 alternating
      processes: 2304 x 768 0.95 -> 0.78 ms, 768 x 3072 1.32 -> 1.06, GPT-2's head 23.8 ->
      18.4), and on int8 tiles a group a tile step (gemm_tile_grouped.py; symmetric weights on
      two planes of 12-bit digits; Emerald Rapids, 128 rows, 2 threads, best of 4 x 5 calls
      interleaved in one process: GPT-2's linears 60.9 -> 43.2 ms, 2304 x 768 2.28 -> 1.76,
      the head 51.5 -> 35.9; GPT-2's prefill 192 -> 143 ms, eager bf16 104). There vpdpbusd,
      at half Zen 5's rate, measured only 2-7% faster than the FMAs (2304 x 768 1.41 -> 1.36
      ms on an Intel Xeon with AMX).

    bf16 x keeps the bf16 GEMM of dequantised weights, faster on the tiles (0.55 against 0.80
    ms) and rounded as eager bf16 rounds."""
    if spec.dtype != "f32":
        return False
    if spec.bits == 4:
        return (spec.group % 32 == 0 and spec.lanes == 16
                and blocking.int8_blocking(spec.n, spec.k, host_target()) is not None)
    return spec.vnni and blocking.int8_blocking(spec.n, spec.k) is not None


def _prefill_planes(spec: LowbitGemmSpec, buf: Buffers, dtype, m: int | None):
    """``call(x, residual) -> out`` for many rows on the u8s8 GEMM (int8 tiles, or ``vpdpbusd``
    where the CPU has no tiles): x's planes once, then per block of W rows (``PREFILL_BLOCK``
    bytes of panels) its panels and the u8s8 GEMM of the planes into the block's output
    columns. The GEMM's epilogue combines each x row's planes (``GemmSpec.planes``): on
    ``vpdpbusd`` in the registers, its 12-row tiles holding whole x rows (Zen 5, 128 rows, 2
    threads, best of 4 alternating processes: 2304 x 768 0.77 -> 0.72 ms, 3072 x 768 with GELU
    1.13 -> 1.05, GPT-2's head 17.7 -> 16.9); on the tiles from each 32-row block's sums, whose
    rows hold 10 x rows' three planes (or 16 rows' two), where a combine kernel read the sums
    back from memory before. int4 weights are unpacked per call into grouped panels, with their sums
    and scales per 32 k, whose int32 sums restart every 32 k (on the tiles: gemm_tile_grouped.py,
    symmetric weights against two planes of 12-bit digits, as exact as three of 8, their sums
    running on over the groups of one scale, up to 128 k, in K blocks of whole runs).
    Rows the planes do not take (non-finite, tiny) go
    through the decode kernel afterwards. Three planes, or two where the user allows float32
    products below full precision (``float32_precision``, read per call; the other count's
    kernels are built on its first call)."""
    n, k, grouped = spec.n, spec.k, spec.bits == 4
    # symmetric int4 on the tiles: two planes of 12-bit digits (gemm_tile_grouped.py)
    twelve = grouped and not spec.zero_point and blocking.int8_blocking(n, k).path == "tile"
    bits = 12 if twelve else 8
    stride = gemm_lowbit_vnni.plane_stride(k, bits)
    nr = gemm_lowbit_planes.NR
    panel = gemm_lowbit_planes.grouped_words(k, bits) * 4 if grouped else nr * stride  # bytes
    per_col = panel // nr
    # the tiles' last group of an 8-bit grouped panel reads rows past it (gemm_tile_grouped.py)
    tail = gemm_tile_grouped.B_TAIL_ROWS * nr * 4 if grouped and not twelve else 0
    nb = n if n * per_col <= PREFILL_WHOLE else max(nr, PREFILL_BLOCK // per_col // nr * nr)
    blocks = [(n0, min(nb, n - n0)) for n0 in range(0, n, nb)]
    w_p, s_p, z_p, b_p = buf.ptrs()     # z_p: int8, the row sums of q (int32); int4, zero points
    # bytes from one W row to the next in each operand (int4: blocks start on whole row blocks)
    w_row, s_row = (t.stride(0) * t.element_size() for t in (buf.w, buf.scale))
    z_row = buf.zp.stride(0) if grouped and z_p else 0
    threads, empty = torch.get_num_threads, torch.empty

    def block_run(width: int, count: int) -> tuple:
        """(``run(a, panels, heads, n0, res, out, rows)`` for a block of ``width`` W rows from
        row ``n0``, its specs)."""
        if grouped:
            ps = LowbitPanelsSpec(width, k, 4, spec.group, spec.zero_point, spec.rr, spec.lanes,
                                  bits)
            blk = blocking.int8_blocking(width, stride // 4)
            scale_k = 32   # the k of one combine of the int32 sums (module doc)
            if blk.path != "tile":   # vpdpbusd: tiles of whole x rows beside their float sums
                blk = blocking.vnni_blocking(width, stride // 4, mr=3 * count)
            elif twelve:   # runs of tile steps a scale, K blocks of whole runs
                scale_k = spec.group
                run_words = gemm_tile_grouped.run_steps(scale_k, bits) * \
                    gemm_tile_grouped.group_words(bits)
                blk = replace(blk, kc=-(-blk.kc // run_words) * run_words)
            unpack = entry(ps, 4)

            def pack(n0, panels):
                unpack(w_p + n0 * w_row, s_p + n0 * s_row, z_p and z_p + n0 * z_row, panels,
                       threads())
        else:
            ps = LowbitPanelsSpec(width, k)
            blk = blocking.int8_blocking(width, stride // 4)
            repack = entry(ps, 2)

            def pack(n0, panels):
                repack(w_p + n0 * k, panels, threads())
        gs = GemmSpec(0, width, stride, 1, "packed", spec.bias, spec.epilogue, spec.residual,
                      **blk.as_kwargs(), dtype="u8s8", planes=count, ldo=n,
                      b_group=scale_k if grouped else 0, plane_bits=bits)
        gemm = entry(gs, 8, 2)

        def run(a, panels, heads, n0, res, out, rows):
            pack(n0, panels)
            columns = (None, None) if grouped else (s_p + n0 * 4, z_p + n0 * 4)
            gemm(a, panels, b_p and b_p + n0 * 4, res, out, heads, *columns, rows * count,
                 threads())
        return run, [ps, gs]

    def kernels(count: int) -> tuple:
        """(planes kernel, {width: block run}, their specs)."""
        planes_spec = LowbitPlanesSpec(k, spec.dtype, count, bits)
        specs, per_width = [planes_spec], {}
        for width in dict.fromkeys(w for _, w in blocks):
            per_width[width], block_specs = block_run(width, count)
            specs += block_specs
        return entry(planes_spec, 3, 2), per_width, specs

    def plane_count() -> int:
        return 2 if twelve else _plane_count()

    first = plane_count()
    built = {first: kernels(first)}
    rest = replace(spec, m=0)           # the rows the planes hand back
    gemv = gemv_run(rest, buf, dtype)
    specs = built[first][2] + [rest]
    esize = 2 if spec.dtype == "bf16" else 4

    def call(x, r):
        rows = x.shape[0]
        out = empty(rows, n, dtype=dtype)
        if rows == 0:
            return out
        count = plane_count()
        heads = empty(rows, gemm_lowbit_vnni.HEAD // 4, dtype=torch.int32)
        while True:
            if count not in built:
                built[count] = kernels(count)
            planes, per_width, _ = built[count]
            a = empty(rows * count, stride, dtype=torch.uint8)
            planes(x.data_ptr(), a.data_ptr(), heads.data_ptr(), rows, threads())
            if twelve or count == gemm_lowbit_vnni.PLANES or bool(heads[:, 3].all()):
                break
            count = gemm_lowbit_vnni.PLANES  # a row's outliers: two planes coarser than TF32
        panels = empty(-(-blocks[0][1] // nr) * panel + tail, dtype=torch.uint8)
        for n0, width in blocks:
            per_width[width](a.data_ptr(), panels.data_ptr(), heads.data_ptr(), n0,
                             None if r is None else r.data_ptr() + n0 * esize,
                             out.data_ptr() + n0 * esize, rows)
        ready = heads[:, 2]
        if not bool(ready.all()):  # non-finite or tiny rows: the decode kernel's float path
            left = (ready == 0).nonzero().flatten()
            out[left] = gemv(x[left], None if r is None else r[left].contiguous())
        return out
    return call, specs


def _plane_count() -> int:
    """x's byte planes for float32 products: 3 exact to float32; 2 (x to 2**-15 of its row's
    largest |x|) where the user allows TF32 or bf16 products."""
    return gemm_lowbit_vnni.PLANES if float32_precision() == "ieee" else 2


def _prefill_fused(spec: LowbitGemmSpec, buf: Buffers, dtype, m: int | None, out: str = ""):
    """``call(x, residual) -> out`` for many rows: the GEMM family's kernel for ``x @ B.T``, on
    the vector path or on bf16 tiles (AMX), with B the low-bit weights dequantised panel by
    panel as its driver packs them (``GemmSpec.b_bits``), so no float copy of the weights is
    made. On the tiles this replaced a dequantised copy of every weight per call, which the
    GEMM then packed (Intel Xeon with AMX, 128 bf16 rows, 2 threads, GPT-2's linears of one
    token's layers and its head: int8 35.7 -> 23.3 ms, int4 36.1 -> 22.3, against eager bf16's
    25-26). ``out="f32"``: bf16 x, a float32 residual and output."""
    n, k, dt = spec.n, spec.k, spec.dtype
    kw = -(-k // 2) if dt == "bf16" else k       # bf16 steps over k pairs
    blk = blocking.choose(m, n, kw, b_layout="nk", dtype=dt)
    if spec.bits == 4 and blk.kc < kw:           # K blocks of whole int4 chunks
        step = gemm_lowbit.chunk(4, spec.lanes) // (2 if dt == "bf16" else 1)
        blk = replace(blk, kc=max(step, blk.kc // step * step))
    if blk.a_pack and (blk.path == "vector" or blk.kc >= kw):
        # B is dequantised and packed once per chunk of M rows: one chunk where the packed A
        # fits half of L2 (Zen 5, 128 rows, float32 int8: GPT-2's head 31.4 -> 26.5 ms with
        # chunks of 128 rows instead of 80, 2304 x 768 1.25 -> 1.16). On the tiles only where
        # K is one block: with several, tile_blocking's chunks bound the partial sums of a
        # chunk's blocks
        most = max(blk.mc, blocking.cache_sizes()[1] // 2 // (blk.kc * 4) // blk.mr * blk.mr)
        blk = replace(blk, mc=min(most, -(-m // blk.mr) * blk.mr) if m else most)
    gspec = GemmSpec(m or 0, n, k, 1, "nk", spec.bias, spec.epilogue, spec.residual,
                     **blk.as_kwargs(), dtype=dt, out=out, b_bits=spec.bits,
                     b_group=spec.group, b_zp=spec.zero_point, b_rr=spec.rr,
                     b_lanes=spec.lanes if spec.bits == 4 else 0)
    gemm = entry(gspec, 7, 1 if m else 2)
    w_p, s_p, z_p, b_p = buf.ptrs()
    if not spec.zero_point:  # (a vnni decode kernel's row sums sit in zp's place)
        z_p = None
    threads, empty = torch.get_num_threads, torch.empty
    pad = dt == "bf16" and k % 2

    def call(x, r):
        rows = x.shape[0]
        out = empty(rows, n, dtype=dtype)
        if rows == 0:
            return out
        if pad:  # A's rows in whole k pairs
            x = F.pad(x, (0, 1))
        ptrs = (x.data_ptr(), w_p, b_p, None if r is None else r.data_ptr(), out.data_ptr(),
                s_p, z_p)
        if m:
            gemm(*ptrs, threads())
        else:
            gemm(*ptrs, rows, threads())
        return out
    return call, [gspec]

