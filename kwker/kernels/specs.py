"""Specs of the compute-kernel families (GEMM, elementwise, attention, fused top-k, LayerNorm,
KV rows).

A spec holds every choice that changes the emitted code: shapes, flags and the blocking the
factory picked for this CPU (so two CPUs with different caches get different specs, and the
packed weight layout always matches the kernel). The ISA comes from the target at emit time.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from ..spec import Spec, register_spec


@register_spec
@dataclass(frozen=True)
class EltwiseSpec(Spec):
    """``out = op(x)`` over ``numel`` contiguous elements (op: gelu, gelu_tanh, relu, exp, ...);
    ``numel`` 0: any size, passed per call (one compile for every shape). ``rows``: a binary op
    over rows of x and y a stride apart (codegen/elementwise.py)."""
    op: str
    numel: int
    dtype: str = "f32"     # element type of x and out ("f32" | "bf16"); maths in float32
    rows: bool = False
    family = "eltwise"


@register_spec
@dataclass(frozen=True)
class RopeSpec(Spec):
    """Rotary position embedding ``x * cos + rotate_half(x) * sin`` over rows of ``d`` (see
    codegen/rope.py); sizes and strides are read per call."""
    d: int
    dtype: str = "f32"     # of x, cos, sin and out ("f32" | "bf16"), rounded as ATen rounds
    # "bf16": x is bf16 and cos, sin and out float32 (autocast: a bf16 projection times the
    # float32 cos, which promotes), with ``dtype`` "f32"
    x: str = ""
    family = "rope"


@register_spec
@dataclass(frozen=True)
class RowCopySpec(Spec):
    """Rows of ``row_bytes`` copied between two strided 3-D layouts (codegen/row_copy.py): a KV
    cache's new rows written into its buffer; sizes and strides are read per call."""
    row_bytes: int
    family = "row_copy"


@register_spec
@dataclass(frozen=True)
class Int4PackSpec(Spec):
    """int4 values (n rows of ``k`` int8, n and the row stride read per call) packed into
    gemm_lowbit.py's nibble layout for ``lanes`` lanes: rows padded to ``kp`` weights, blocks
    of ``rr`` rows (codegen/int4_pack.py)."""
    k: int
    kp: int
    rr: int
    lanes: int = 16
    family = "int4_pack"


@register_spec
@dataclass(frozen=True)
class ChainSpec(Spec):
    """Kernels called one after another by one native function (codegen/chain.py): a decode
    step's linears and norms between two attentions with no Python between them. Addresses are
    not part of it (they are data, in its word table), so every layer of a model shares one.

    ``calls``: per kernel, its ABI words as space-separated tokens, the first its entry point:
    ``w<i>`` word i of the table, ``t<j>`` tensor argument j, ``s<i>`` scratch buffer i, ``r``
    the rows, ``e<k>`` the rows times k, ``n`` the threads, ``z`` null. ``scratch``: the bytes
    a row of each scratch buffer takes (the intermediates no one outside reads); ``tensors``:
    tensor arguments."""
    calls: tuple
    scratch: tuple = ()
    tensors: int = 0
    family = "chain"

    @property
    def symbol(self) -> str:
        return "kw_chain_" + hashlib.sha1(self.id.encode()).hexdigest()[:16]


@register_spec
@dataclass(frozen=True)
class GemmSpec(Spec):
    """``C = act(A @ B + bias) + residual`` for fixed shapes and blocking (see codegen/gemm.py).

    ``b_layout``: ``packed`` (weights pre-packed into ``nr``-wide panels by the factory; on the
    tile path each panel's K is zero-padded to whole tiles, see ``gemm_tile.padded_k``), ``kn``
    (runtime row-major B) or ``nk`` (runtime B given transposed). ``a_pack=False`` is the
    small-M schedule (no packing, ``mr == m``, K unblocked).
    """
    m: int
    n: int
    k: int
    batch: int = 1
    b_layout: str = "packed"
    bias: bool = False
    epilogue: str = "none"
    residual: bool = False
    mr: int = 12
    nr: int = 32
    kc: int = 256
    mc: int = 252
    nb: int = 16
    a_pack: bool = True
    ksplit: int = 1
    unroll: int = 1
    dtype: str = "f32"     # "bf16": bf16 A/B/residual/out, float32 accumulation and epilogue
    path: str = "vector"   # "tile": 32x32 blocks of matrix tiles (codegen/gemm_tile.py)
    # the residual's and the output's type when not ``dtype``: "f32" with bf16 packed weights
    # (autocast's float32 residual stream added to a bf16 linear, without rounding the product)
    out: str = ""
    # B given as low-bit weights (``b_layout`` "nk", the vector path): int8 (8) or int4 (4) W
    # rows in gemm_lowbit.py's layout, dequantised into each panel as it is packed, with two
    # more pointers after the five (float32 scales, int8 zero points; per ``b_group`` along K);
    # int4: ``b_rr``-row blocks packed for ``b_lanes`` lanes. K may then be odd in bf16: A's rows
    # are padded to whole pairs by the caller
    b_bits: int = 0
    b_group: int = 0
    b_zp: bool = False
    b_rr: int = 1
    b_lanes: int = 0
    # u8s8 on x's byte planes (the int8 prefill, codegen/gemm_lowbit_planes.py): A holds
    # ``planes`` rows per x row, and the epilogue combines them into one row of C, ``ldo`` floats
    # apart (0: n; more when C is a block of a wider output's columns), from three more
    # pointers after the five: the x rows' heads, the columns' scales and their sums of q
    planes: int = 0
    ldo: int = 0
    # x's bits a plane: 8, or 12 (int4 groups on the tiles: two planes of 12-bit digits against
    # (q, 16 q) weight bytes, gemm_tile_grouped.py)
    plane_bits: int = 8
    family = "gemm"

    @property
    def symbol(self) -> str:
        flags = (("_bias" if self.bias else "") + ("" if self.epilogue == "none" else
                 "_" + self.epilogue) + ("_res" if self.residual else ""))
        return (f"kw_gemm_{self.m}x{self.n}x{self.k}_b{self.batch}_{self.b_layout}{flags}"
                f"_t{self.mr}x{self.nr}_kc{self.kc}_mc{self.mc}_nb{self.nb}"
                f"_p{int(self.a_pack)}_s{self.ksplit}_u{self.unroll}"
                + ("" if self.dtype == "f32" else "_" + self.dtype)
                + ("" if self.path == "vector" else "_" + self.path)
                + (f"_o{self.out}" if self.out else "")
                + (f"_q{self.b_bits}g{self.b_group}{'z' if self.b_zp else ''}r{self.b_rr}"
                   f"l{self.b_lanes}" if self.b_bits else "")
                + (f"_pl{self.planes}o{self.ldo}" if self.planes else "")
                + (f"g{self.b_group}" if self.planes and self.b_group > 32 else "")
                + (f"d{self.plane_bits}" if self.plane_bits != 8 else ""))


@register_spec
@dataclass(frozen=True)
class AttentionSpec(Spec):
    """Flash-style SDPA over (batch, heads, L, E) float32 (see codegen/attention.py).

    ``mask`` is none, bool (True keeps), fill (bool, True masks: ``masked_fill``'s condition) or
    float; ``mask_shape`` its 4-D shape (1 = broadcast). ``scale`` 0 means 1/sqrt(e).
    Blocking: ``bq`` query rows x ``bk`` keys per step, ``nr``-key panels, ``mrs``/``mro`` rows
    per micro-tile of the score and output products.

    ``batch = lq = lk = 0``: the generic kernel (codegen/attention_args.py), one for every size
    and layout: sizes and all strides are read at call time, ``strides`` stays (), and
    ``mask_shape`` has 1 on broadcast dims and 0 on full-size ones.
    """
    batch: int
    heads: int
    lq: int
    lk: int
    e: int
    ev: int
    causal: bool = False
    scale: float = 0.0
    mask: str = "none"
    mask_shape: tuple = ()
    bq: int = 24
    bk: int = 256
    nr: int = 32
    mrs: int = 12
    mro: int = 12
    # element strides (batch, head, row) of q, k, v and the output; () = contiguous (B, H, L, E).
    # Heads packed side by side in one row (TransformerEncoderLayer's q/k/v views, ATen's output
    # layout) are read and written in place.
    strides: tuple = ()
    dtype: str = "f32"     # "bf16": bf16 q/k/v/out, float32 softmax and accumulation
    # grouped-query attention: k/v have ``kv_heads`` heads, query head h reads kv head
    # h // (heads // kv_heads); 0 = as many as the query
    kv_heads: int = 0
    # "tile": both products of bf16 attention on matrix tiles (codegen/attention_tile.py)
    path: str = "vector"
    # a row with no finite score gives NaN, as softmax written out gives it (attention matched
    # from matmul + softmax + matmul); False: 0, as ATen's scaled_dot_product_attention
    empty_nan: bool = False
    # what a "fill" mask puts in place of a masked score (after the scale): masked_fill's value
    fill: float = -math.inf
    family = "attention"

    def __post_init__(self):
        if (self.batch, self.lq, self.lk).count(0) not in (0, 3) or \
                (not self.batch and self.strides):
            raise ValueError(f"AttentionSpec: batch, lq and lk are all 0 (generic, no strides) "
                             f"or all sizes, not {self.batch, self.lq, self.lk}")

    @property
    def symbol(self) -> str:
        import struct
        scale = struct.unpack("<I", struct.pack("<f", self.scale))[0]
        ms = "x".join(map(str, self.mask_shape)) if self.mask_shape else "0"
        return (f"kw_sdpa_{self.batch}x{self.heads}x{self.lq}x{self.lk}_e{self.e}_ev{self.ev}"
                f"_c{int(self.causal)}_s{scale:08x}_{self.mask}{ms}"
                f"_q{self.bq}_k{self.bk}_n{self.nr}_{self.mrs}_{self.mro}"
                + ("_st" + "_".join("x".join(map(str, t)) for t in self.strides)
                   if self.strides else "")
                + ("" if self.dtype == "f32" else "_" + self.dtype)
                + (f"_g{self.kv_heads}" if self.kv_heads else "")
                + ("" if self.path == "vector" else "_" + self.path)
                + ("_nan" if self.empty_nan else "")
                + ("" if self.fill == -math.inf else
                   f"_f{struct.unpack('<I', struct.pack('<f', self.fill))[0]:08x}"))


@register_spec
@dataclass(frozen=True)
class TopkGemmSpec(Spec):
    """Fused ``topk(x @ W.T, k)`` over ``m`` rows of ``n`` scores with ``k_dim`` features, W
    pre-packed into ``nr``-wide panels; ``mr`` rows per micro-tile (see codegen/fused_topk.py).
    ``m`` 0: any row count, passed per call (one compile for every batch size)."""
    m: int
    n: int
    k_dim: int
    k: int
    largest: bool = True
    mr: int = 8
    nr: int = 48
    approx: str = "none"   # "bf16": screen with bf16 dot products, rescore survivors in float32
    dtype: str = "f32"     # "bf16": bf16 x and W, scores rounded to bf16 as eager rounds them
    path: str = "vector"   # "tile": the bf16 screen of 32 x 32 blocks on matrix tiles
    family = "topk_gemm"

    @property
    def symbol(self) -> str:
        return (f"kw_linear_topk_{self.m}x{self.n}x{self.k_dim}_k{self.k}_l{int(self.largest)}"
                f"_t{self.mr}x{self.nr}"  # screening and operand type named apart: one symbol
                + ("" if self.approx == "none" else f"_screen_{self.approx}")  # per kernel
                + ("" if self.dtype == "f32" else "_" + self.dtype)
                + ("" if self.path == "vector" else "_" + self.path))


@register_spec
@dataclass(frozen=True)
class LayerNormSpec(Spec):
    """``out = (x - mean) * rstd * w + b`` over ``rows`` rows of ``d`` contiguous elements (see
    codegen/layernorm.py); ``rows`` 0: any row count, passed per call (one compile for every
    batch and sequence size). ``weight``/``bias``: whether w and b are read (float32 buffers).
    ``norm``: ``layer``, or RMSNorm ``x * rsqrt(mean(x^2) + eps) * w`` as ``rms`` (one rounding,
    ATen's ``rms_norm``) or ``rms_hf`` (rounded to x's dtype before the weight, as transformers'
    Llama/T5 norms compute it)."""
    d: int
    rows: int
    eps: float
    weight: bool
    bias: bool
    dtype: str = "f32"     # element type of x and out ("f32" | "bf16"); maths in float32
    norm: str = "layer"
    out: str = ""          # out's type when not x's: "bf16" for float32 x (autocast's cast of a
    #                        float32 norm's output for the bf16 product after it, done here)
    family = "layernorm"

    @property
    def symbol(self) -> str:
        import struct
        eps = struct.unpack("<Q", struct.pack("<d", self.eps))[0]  # bit-exact: one symbol per eps
        return (f"kw_layernorm_d{self.d}_r{self.rows}_e{eps:016x}"
                f"_w{int(self.weight)}_b{int(self.bias)}"
                + ("" if self.dtype == "f32" else "_" + self.dtype)
                + ("" if self.norm == "layer" else "_" + self.norm)
                + (f"_o{self.out}" if self.out else ""))


def instruction_path(spec, target) -> str:
    """The instructions ``spec`` runs on for ``target``: ``amx`` (``amx-emulated``) for the tile
    path, ``avx512-bf16`` for bf16 dot products on AVX512_BF16, ``avx512-vnni`` for int8 ones
    on AVX512_VNNI, else ``avx512``, ``avx2`` or ``sse`` by the vector width."""
    if getattr(spec, "path", "vector") == "tile":
        return "amx" if target.tiles == "amx" else "amx-emulated"
    width = {512: "avx512", 256: "avx2"}.get(target.vector_bits, "sse")
    dtype = getattr(spec, "dtype", "f32")
    if dtype == "bf16" and width == "avx512" and target.has("avx512bf16"):
        return "avx512-bf16"
    if dtype == "u8s8" and width == "avx512":
        return "avx512-vnni"
    return width


@register_spec
@dataclass(frozen=True)
class LowbitGemmSpec(Spec):
    """``out = act(x @ deq(W).T + bias) + residual`` with int8/int4 weights and float scales per
    group of ``group`` along K (see codegen/gemm_lowbit.py). ``m`` 0: the row count is passed per
    call. ``lanes`` is the vector width the int4 weights were packed for; ``mr`` x ``rr`` the
    tile of x rows by W rows."""
    m: int
    n: int
    k: int
    bits: int
    group: int
    zero_point: bool = False
    bias: bool = False
    epilogue: str = "none"
    residual: bool = False
    dtype: str = "f32"
    lanes: int = 16
    mr: int = 1
    rr: int = 8
    vnni: bool = False     # on vpdpbusd over x's byte planes (gemm_lowbit_vnni, _vnni4)
    digits: int = 3        # int4 there: x's byte digits, 3 exact to float32, 2 (bf16 x) coarser
    ahead: int = 4096      # bytes the decode's weight stream is prefetched ahead; 0: not at all
    family = "gemm_lowbit"


@register_spec
@dataclass(frozen=True)
class LowbitPlanesSpec(Spec):
    """x rows (float32 or bf16, ``k`` each) -> their byte planes and heads
    (codegen/gemm_lowbit_vnni.py), the A operand of the int8 prefill on tiles; ``planes`` 3
    (exact to float32) or 2 (float32 products below full precision allowed)."""
    k: int
    dtype: str = "f32"
    planes: int = 3
    plane_bits: int = 8    # 12: two planes of 12-bit digits, two bytes a k (int4 on tiles)
    family = "lowbit_planes"


@register_spec
@dataclass(frozen=True)
class LowbitPanelsSpec(Spec):
    """``n`` int8 W rows of ``k`` -> the u8s8 GEMM's B panels, made per call. ``bits`` 4: int4
    W rows in gemm_lowbit.py's layout (``rr``-row blocks for ``lanes`` lanes, scales and zero
    points per ``group``) -> the grouped panels of the byte planes (gemm_lowbit_planes.py)."""
    n: int
    k: int
    bits: int = 8
    group: int = 0
    zero_point: bool = False
    rr: int = 1
    lanes: int = 16
    plane_bits: int = 8    # 12: int4 words of two k as (q, 16 q) bytes, for 12-bit planes
    family = "lowbit_panels"


