"""bfloat16 <-> float32 in vector registers: the one place every emitter converts.

bf16 is the upper half of a float32, so widening is a shift (exact, every ISA) and narrowing is
ATen's ``round_to_nearest_even``: add ``0x7FFF`` plus the lowest kept bit, keep the upper half,
and every NaN becomes ``0x7FC0`` (c10/util/BFloat16.h). Integer ops only, so AVX2 and AVX-512
without AVX512_BF16 emit the same rounding as a CPU with ``vcvtneps2bf16``.

``native=True`` (16 lanes on a CPU with AVX512_BF16) rounds with ``vcvtneps2bf16`` instead: one
instruction for eight, the same round to nearest even, except that a float32 denormal becomes
0 (the instruction flushes, as ``vdpbf16ps`` does its inputs) and a NaN keeps its sign and
payload. GEMM and attention outputs use it (an accuracy contract, and their dot products flush
denormals anyway); elementwise kernels, bit-identical to ATen's, do not.

Kernels hold bf16 data as ``i16`` lanes; float32 maths happens in between.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import NamedType, f32, i16, i32, intrinsic, ptr


def native(target) -> bool:
    """Whether bf16 runs natively here: ``vdpbf16ps`` and ``vcvtneps2bf16`` on 16 float32 lanes
    (AVX-512 with AVX512_BF16); elsewhere bf16 is widened to float32 and rounded by integer ops."""
    return simd.float_lanes(target) == 16 and target.has("avx512bf16")


def i16v(lanes: int) -> ir.VectorType:
    return ir.VectorType(i16, lanes)


def i32v(lanes: int) -> ir.VectorType:
    return ir.VectorType(i32, lanes)


def _splat_i32(lanes: int, value: int) -> ir.Constant:
    return ir.Constant(i32v(lanes), [ir.Constant(i32, value)] * lanes)


def widen(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """``<L x i16>`` bf16 bits -> ``<L x float>`` (exact)."""
    lanes = h.type.count
    wide = b.shl(b.zext(h, i32v(lanes)), _splat_i32(lanes, 16))
    return b.bitcast(wide, simd.vty(lanes))


# LLVM's ``bfloat`` (llvmlite.ir has no such type): only to name the result of
# ``vcvtneps2bf16``, which is bitcast to i16 lanes at once
BFLOAT = NamedType("bfloat")


def narrow(b: ir.IRBuilder, x: ir.Value, native: bool = False) -> ir.Value:
    """``<L x float>`` -> ``<L x i16>`` bf16 bits, round to nearest even, NaN -> 0x7FC0
    (``native``: see the module doc)."""
    lanes = x.type.count
    if native:
        cvt = intrinsic(b.module, f"llvm.x86.avx512bf16.cvtneps2bf16.{lanes * 32}",
                        ir.VectorType(BFLOAT, lanes), [x.type])
        return b.bitcast(b.call(cvt, [x]), i16v(lanes))
    bits = b.bitcast(x, i32v(lanes))
    odd = b.and_(b.lshr(bits, _splat_i32(lanes, 16)), _splat_i32(lanes, 1))
    rounded = b.lshr(b.add(bits, b.add(odd, _splat_i32(lanes, 0x7FFF))), _splat_i32(lanes, 16))
    nan = b.fcmp_unordered("uno", x, x)
    return b.trunc(b.select(nan, _splat_i32(lanes, 0x7FC0), rounded), i16v(lanes))


def narrow_scalar(b: ir.IRBuilder, x: ir.Value, native: bool = False) -> ir.Value:
    """float -> i16 bf16 bits, as ``narrow``."""
    if native:  # lane 0 of the 16-lane instruction
        vt = simd.vty(16)
        v = b.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(i32, 0))
        return b.extract_element(narrow(b, v, True), ir.Constant(i32, 0))
    bits = b.bitcast(x, i32)
    odd = b.and_(b.lshr(bits, ir.Constant(i32, 16)), ir.Constant(i32, 1))
    rounded = b.lshr(b.add(bits, b.add(odd, ir.Constant(i32, 0x7FFF))), ir.Constant(i32, 16))
    nan = b.fcmp_unordered("uno", x, x)
    return b.trunc(b.select(nan, ir.Constant(i32, 0x7FC0), rounded), i16)


def widen_scalar(b: ir.IRBuilder, h: ir.Value) -> ir.Value:
    return b.bitcast(b.shl(b.zext(h, i32), ir.Constant(i32, 16)), f32)


def _mask_of(lanes: int, active: int) -> ir.Constant:
    return simd.const_mask(lanes, active)


def load(b: ir.IRBuilder, base: ir.Value, index, lanes: int, active: int | None = None,
         mask: ir.Value | None = None) -> ir.Value:
    """``lanes`` bf16 at ``base[index]`` (element index) as float32; only the first ``active``
    (compile-time) lanes, or the lanes of ``mask``, are read, the rest are 0."""
    vt = i16v(lanes)
    addr = simd.gep(b, base, index, i16)
    if mask is None and (active is None or active >= lanes):
        return widen(b, b.load(addr, typ=vt, align=2))
    if mask is None:
        mask = _mask_of(lanes, active)
    fn = intrinsic(b.module, f"llvm.masked.load.v{lanes}i16.p0", vt, [ptr, i32, mask.type, vt])
    zero = ir.Constant(vt, [ir.Constant(i16, 0)] * lanes)
    return widen(b, b.call(fn, [addr, ir.Constant(i32, 2), mask, zero]))


def store(b: ir.IRBuilder, x: ir.Value, base: ir.Value, index, active: int | None = None,
          mask: ir.Value | None = None, native: bool = False) -> None:
    """Round float32 lanes ``x`` to bf16 (``narrow``) and store them at ``base[index]``
    (element index); only the first ``active`` lanes (or those of ``mask``) are written."""
    lanes = x.type.count
    h = narrow(b, x, native)
    addr = simd.gep(b, base, index, i16)
    if mask is None and (active is None or active >= lanes):
        b.store(h, addr, align=2)
        return
    if mask is None:
        mask = _mask_of(lanes, active)
    fn = intrinsic(b.module, f"llvm.masked.store.v{lanes}i16.p0", ir.VoidType(),
                   [h.type, ptr, i32, mask.type])
    b.call(fn, [h, addr, ir.Constant(i32, 2), mask])


def load_as(b: ir.IRBuilder, dtype: str, base, index, lanes: int, active: int | None = None):
    """Load float32 lanes from a ``dtype`` ("f32" | "bf16") buffer (element index)."""
    if dtype == "bf16":
        return load(b, base, index, lanes, active)
    return simd.load_any(b, base, index, lanes, lanes if active is None else active)


def store_as(b: ir.IRBuilder, dtype: str, x, base, index, active: int | None = None,
             native: bool = False) -> None:
    """Store float32 lanes ``x`` to a ``dtype`` buffer (rounded once if bf16, see ``narrow``)."""
    if dtype == "bf16":
        store(b, x, base, index, active, native=native)
    else:
        simd.store_any(b, x, base, index, x.type.count if active is None else active)


def itemsize(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4
