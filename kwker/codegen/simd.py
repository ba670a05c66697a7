"""Vector helpers shared by the kernel emitters: lane counts, broadcasts, masked memory access.

The vector width comes from the target (16 float lanes with AVX-512, 8 with AVX2); partial vectors
at the edges of rows use ``llvm.masked.load`` / ``llvm.masked.store``, which lower to AVX-512 mask
registers or AVX ``vmaskmov``, so edges need no scalar loop.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import f32, i1, i32, i64, intrinsic, ptr


def float_lanes(target) -> int:
    """float32 lanes per vector register on ``target``."""
    return max(4, target.vector_bits // 32)


def vty(lanes: int, elem: ir.Type = f32) -> ir.VectorType:
    return ir.VectorType(elem, lanes)


def broadcast(b: ir.IRBuilder, value: ir.Value, lanes: int) -> ir.Value:
    """Splat a scalar into every lane (insertelement + zero shufflevector: vbroadcastss)."""
    vt = ir.VectorType(value.type, lanes)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), value, ir.Constant(i32, 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(i32, lanes), [0] * lanes))


def gep(b: ir.IRBuilder, base: ir.Value, index, ty: ir.Type = f32) -> ir.Value:
    if not isinstance(index, ir.Value):
        index = ir.Constant(i64, index)
    return b.gep(base, [index], inbounds=True, source_etype=ty)


def _name(elem: ir.Type) -> str:
    """The element's suffix in intrinsic names (v16f32, v64i8...)."""
    return "f32" if elem == f32 else str(elem)


def _size(elem: ir.Type) -> int:
    return 4 if elem == f32 else elem.width // 8


def load_vec(b: ir.IRBuilder, base: ir.Value, index, lanes: int, align: int | None = None,
             elem: ir.Type = f32) -> ir.Value:
    """``lanes`` elements of type ``elem`` from ``base[index]`` (index in elements)."""
    return b.load(gep(b, base, index, elem), typ=vty(lanes, elem), align=align or _size(elem))


def store_vec(b: ir.IRBuilder, value: ir.Value, base: ir.Value, index, align: int | None = None,
              elem: ir.Type = f32) -> None:
    b.store(value, gep(b, base, index, elem), align=align or _size(elem))


# bytes ahead of its reads a thread's stream of weights is prefetched (the low-bit decode's rows,
# the GEMM's pre-packed panels: gemm_micro.py)
STREAM_AHEAD = 4096


def prefetch(b: ir.IRBuilder, addr: ir.Value, keep: bool = True) -> None:
    """Ask for the cache line at ``addr`` ahead of its use: into every cache level (``keep``), or
    non-temporally (L1 alone on Intel cores, around the other levels on AMD's)."""
    fn = intrinsic(b.module, "llvm.prefetch.p0", ir.VoidType(), [ptr, i32, i32, i32])
    b.call(fn, [addr, ir.Constant(i32, 0), ir.Constant(i32, 3 if keep else 0),
                ir.Constant(i32, 1)])


def prefetch_l2(b: ir.IRBuilder, addr: ir.Value) -> None:
    """Ask for the cache line at ``addr`` into L2 but not L1 (``prefetcht1``): for data read
    from L2 by loads that bypass L1 (the tile path's B panels, gemm_tile.py)."""
    fn = intrinsic(b.module, "llvm.prefetch.p0", ir.VoidType(), [ptr, i32, i32, i32])
    b.call(fn, [addr, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])


def load_scalar(b: ir.IRBuilder, base: ir.Value, index, ty: ir.Type = f32) -> ir.Value:
    return b.load(gep(b, base, index, ty), typ=ty)


def const_mask(lanes: int, active: int) -> ir.Constant:
    """A compile-time mask with the first ``active`` lanes on."""
    return ir.Constant(ir.VectorType(i1, lanes), [int(j < active) for j in range(lanes)])


def lane_mask(b: ir.IRBuilder, lanes: int, active: ir.Value) -> ir.Value:
    """Lanes ``j < active`` (a runtime i64) on."""
    ids = ir.Constant(ir.VectorType(i64, lanes), list(range(lanes)))
    return b.icmp_signed("<", ids, broadcast(b, active, lanes))


def masked_load(b: ir.IRBuilder, base: ir.Value, index, mask: ir.Value, lanes: int,
                passthru: float = 0.0, elem: ir.Type = f32) -> ir.Value:
    """The lanes of ``mask`` from ``base[index]`` (``elem`` elements), ``passthru`` elsewhere;
    masked-off lanes are not read."""
    vt = vty(lanes, elem)
    fn = intrinsic(b.module, f"llvm.masked.load.v{lanes}{_name(elem)}.p0", vt,
                   [ptr, i32, mask.type, vt])
    fill = ir.Constant(vt, [ir.Constant(elem, passthru if elem == f32 else int(passthru))]
                       * lanes)
    return b.call(fn, [gep(b, base, index, elem), ir.Constant(i32, _size(elem)), mask, fill])


def masked_store(b: ir.IRBuilder, value: ir.Value, base: ir.Value, index, mask: ir.Value,
                 elem: ir.Type = f32) -> None:
    lanes = value.type.count
    fn = intrinsic(b.module, f"llvm.masked.store.v{lanes}{_name(elem)}.p0", ir.VoidType(),
                   [value.type, ptr, i32, mask.type])
    b.call(fn, [value, gep(b, base, index, elem), ir.Constant(i32, _size(elem)), mask])


def load_any(b, base, index, lanes: int, active: int, elem: ir.Type = f32) -> ir.Value:
    """Load ``active`` (compile-time) of ``lanes`` elements, zero-filling the rest."""
    if active >= lanes:
        return load_vec(b, base, index, lanes, elem=elem)
    return masked_load(b, base, index, const_mask(lanes, active), lanes, elem=elem)


def store_any(b, value, base, index, active: int, elem: ir.Type = f32) -> None:
    """Store the first ``active`` (compile-time) lanes of ``value``."""
    if active >= value.type.count:
        store_vec(b, value, base, index, elem=elem)
    else:
        masked_store(b, value, base, index, const_mask(value.type.count, active), elem)


def _tree(b: ir.IRBuilder, v: ir.Value, combine) -> ir.Value:
    """Reduce a vector by halving (log2 steps of vector ops), lane 0 of the last step."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n), list(range(n))))
        hi = b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, n), list(range(n, 2 * n))))
        v = combine(lo, hi)
    return b.extract_element(v, ir.Constant(i32, 0))


def hsum(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Sum of the lanes as a tree (not LLVM's ordered reduction, 16 dependent adds)."""
    return _tree(b, v, b.fadd)


def hmax(b: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Max of the lanes as a tree of ordered compares (NaN lanes lose, like ``maxps``)."""
    return _tree(b, v, lambda x, y: b.select(b.fcmp_ordered(">", x, y), x, y))


def store_scalar(b: ir.IRBuilder, value: ir.Value, base: ir.Value, index) -> None:
    b.store(value, gep(b, base, index, value.type))
