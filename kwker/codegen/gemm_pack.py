"""Packing routines of the GEMM: operands copied into the layouts the micro-kernel streams.

- ``A`` micro-panels (``pack_rows``): rows ``[0, rows)`` x ``kc`` columns of a row-major matrix
  become tiles of ``mr`` rows stored k-major, ``dst[t][k][r]`` (``mr`` consecutive floats per k,
  the broadcasts of one k step share a cache line). Rows past ``rows`` are zero, so an edge tile
  computes garbage-free zeros and the kernel only has to skip storing them. The same routine packs
  a transposed B (``(n, k)`` row-major) into N panels.
- ``B`` panels from a row-major ``(k, n)`` matrix (``pack_cols``): ``nr``-wide column strips,
  ``dst[q][k][j]``, zero-padded past column ``cols``; whole-vector copies, masked at the edge.

- bf16 ``B`` panels from a row-major ``(k, n)`` matrix (``pack_cols(pairs=True)``): the same
  panels of 32-bit words, each the bf16 pair (row 2p, row 2p + 1) of one column (the layout
  ``vdpbf16ps`` multiplies). A bf16 A, or a bf16 B given transposed, is already made of such
  pairs along its rows: ``pack_rows`` moves them as words.

Weights of ``linear`` are packed once, at build time, by the factory in the same panel layout.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, defined, f32, i16, i32, i64, intrinsic, ptr, void


def emit_pack_rows(module: ir.Module, mr: int, ld: int, lanes: int = 0) -> ir.Function:
    """``void pack_rows(ptr src, i64 rows, i64 kc, ptr dst)``: tiles of ``mr`` rows, k-major.

    ``src`` points at element (0, k0) of a row-major matrix with row stride ``ld``. With
    ``lanes`` (the vector width), blocks of lanes x lanes are transposed in registers.
    """
    if lanes >= 4:
        return _emit_pack_rows_vec(module, mr, ld, lanes)
    name = f"pack_rows.{mr}.{ld}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, i64, ptr], ["src", "rows", "kc", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, kc, dst = f.args
    b = f.b
    tiles = b.sdiv(b.add(rows, const(i64, mr - 1)), const(i64, mr))
    with f.for_range(0, tiles, name="t") as t:
        tile_dst = b.mul(t, b.mul(kc, const(i64, mr)))
        row0 = b.mul(t, const(i64, mr))
        with f.for_range(0, mr, name="r") as r:  # a loop, not unrolled: small code
            row = b.add(row0, r)
            with f.if_else(b.icmp_signed("<", row, rows)) as (real, pad):
                with real:
                    rbase = b.mul(row, const(i64, ld))
                    with f.for_range(0, kc, name="k") as k:
                        v = simd.load_scalar(b, src, b.add(rbase, k))
                        idx = b.add(tile_dst, b.add(b.mul(k, const(i64, mr)), r))
                        simd.store_scalar(b, v, dst, idx)
                with pad:
                    with f.for_range(0, kc, name="kz") as k:
                        idx = b.add(tile_dst, b.add(b.mul(k, const(i64, mr)), r))
                        simd.store_scalar(b, ir.Constant(f32, 0.0), dst, idx)
    return f.finish()


def emit_pack_cols(module: ir.Module, nr: int, ld: int, lanes: int,
                   pairs: bool = False) -> ir.Function:
    """``void pack_cols(ptr src, i64 cols, i64 kc, ptr dst)``: ``nr``-wide panels, k-major.

    ``src`` points at element (k0, 0) of a row-major ``(k, n)`` matrix with row stride ``ld``.
    With ``pairs`` the matrix is bf16 and ``kc`` counts k pairs: ``dst[q][p][j]`` is the word
    (src[2p][j], src[2p+1][j]), and ``src`` points at element (2 p0, 0).
    """
    name = f"pack_cols{'_pairs' if pairs else ''}.{nr}.{ld}.{lanes}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, i64, ptr], ["src", "cols", "kc", "dst"])
    f.fn.attributes.add("noinline")
    src, cols, kc, dst = f.args
    b = f.b
    nv = nr // lanes
    if pairs:
        ht = ir.VectorType(i16, lanes)
        load16 = intrinsic(module, f"llvm.masked.load.v{lanes}i16.p0", ht,
                           [ptr, i32, ir.VectorType(ir.IntType(1), lanes), ht])
        zero = ir.Constant(ht, [ir.Constant(i16, 0)] * lanes)
        zip_lanes = ir.Constant(ir.VectorType(i32, 2 * lanes),
                                [j // 2 + (lanes if j % 2 else 0) for j in range(2 * lanes)])
    panels = b.sdiv(b.add(cols, const(i64, nr - 1)), const(i64, nr))
    with f.for_range(0, panels, name="q") as q:
        col0 = b.mul(q, const(i64, nr))
        pdst = b.mul(q, b.mul(kc, const(i64, nr)))
        masks = [simd.lane_mask(b, lanes, b.sub(cols, b.add(col0, const(i64, v * lanes))))
                 for v in range(nv)]
        with f.for_range(0, kc, name="k") as k:
            row = b.mul(k, const(i64, 2 * ld if pairs else ld))
            sbase = b.add(row, col0)
            dbase = b.add(pdst, b.mul(k, const(i64, nr)))
            for v in range(nv):
                at = b.add(sbase, const(i64, v * lanes))
                if not pairs:
                    x = simd.masked_load(b, src, at, masks[v], lanes)
                    simd.store_vec(b, x, dst, b.add(dbase, const(i64, v * lanes)))
                    continue
                even, odd = (b.call(load16, [simd.gep(b, src, i, i16), const(i32, 2), masks[v],
                                             zero]) for i in (at, b.add(at, const(i64, ld))))
                words = b.bitcast(b.shuffle_vector(even, odd, zip_lanes),
                                  ir.VectorType(i32, lanes))
                b.store(words, simd.gep(b, dst, b.add(dbase, const(i64, v * lanes)), i32),
                        align=4)
    return f.finish()


def transpose(b: ir.IRBuilder, rows: list) -> list:
    """Transpose a square block of vectors (row j lane c -> row c lane j): log2(n) butterfly
    stages of two-source shuffles (``vpermt2ps`` / ``vshufps`` and friends)."""
    n = len(rows)
    rows = list(rows)
    h = n // 2
    while h >= 1:
        for i in range(n):
            if i & h:
                continue
            p = i + h
            lo = [(n + c - h) if c & h else c for c in range(n)]
            hi = [(n + c) if c & h else c + h for c in range(n)]
            mask_t = ir.VectorType(ir.IntType(32), n)
            a, c = rows[i], rows[p]
            rows[i] = b.shuffle_vector(a, c, ir.Constant(mask_t, lo))
            rows[p] = b.shuffle_vector(a, c, ir.Constant(mask_t, hi))
        h //= 2
    return rows


def _emit_pack_rows_vec(module: ir.Module, mr: int, ld: int, L: int) -> ir.Function:
    """pack_rows with in-register transposes: per group of <= L rows and block of L k's, L
    (masked) row loads, one L x L transpose, L (masked) stores of the group's lanes."""
    name = f"pack_rows.v{L}.{mr}.{ld}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, i64, ptr], ["src", "rows", "kc", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, kc, dst = f.args
    b = f.b
    zero = ir.Constant(simd.vty(L), [ir.Constant(f32, 0.0)] * L)
    tiles = b.sdiv(b.add(rows, const(i64, mr - 1)), const(i64, mr))
    with f.for_range(0, tiles, name="t") as t:
        tile_dst = b.mul(t, b.mul(kc, const(i64, mr)))
        row0 = b.mul(t, const(i64, mr))

        def group(rg, width: int):
            """The rows rg .. rg + width of tile t (rg: a constant or the group loop's)."""
            first = b.add(row0, rg)
            valid = b.sub(rows, first)  # rows of this group that exist (may be <= 0 or > L)

            def block(k0, kl):
                kmask = simd.lane_mask(b, L, kl)
                vecs = []
                for j in range(L):
                    if j >= width:
                        vecs.append(zero)
                        continue
                    live = b.icmp_signed(">", valid, const(i64, j))
                    m = b.and_(kmask, _splat_i1(b, live, L))
                    idx = b.add(b.mul(b.add(first, const(i64, j)), const(i64, ld)), k0)
                    vecs.append(simd.masked_load(b, src, idx, m, L))
                cols = transpose(b, vecs)
                # the stores twice (cheap code, unlike the transpose): plain in full blocks,
                # masked in the K tail
                with f.if_else(b.icmp_signed("==", kl, const(i64, L))) as (full, tail):
                    for part in (full, tail):
                        with part:
                            for kk in range(L):
                                idx = b.add(tile_dst, b.add(b.mul(b.add(k0, const(i64, kk)),
                                                                  const(i64, mr)),
                                                            rg))
                                if part is full:
                                    simd.store_any(b, cols[kk], dst, idx, width)
                                    continue
                                keep = _splat_i1(b, b.icmp_signed("<", const(i64, kk), kl), L)
                                simd.masked_store(b, cols[kk], dst, idx,
                                                  b.and_(simd.const_mask(L, width), keep))

            if L >= 16:
                # one block body for the full blocks and the K tail (its k's masked): the 16 x 16
                # transpose is most of this function's compile time, so it is emitted once
                with f.for_range(0, kc, step=L, name="kb") as k0:
                    left = b.sub(kc, k0)
                    block(k0, b.select(b.icmp_signed("<", left, const(i64, L)), left,
                                       const(i64, L)))
            else:
                # AVX2: full blocks without run-time masks (its masked loads and stores took the
                # packing 1.4x longer), then the tail; an 8 x 8 transpose compiles quickly
                kfull = b.mul(b.sdiv(kc, const(i64, L)), const(i64, L))
                with f.for_range(0, kfull, step=L, name="kb") as k0:
                    block(k0, const(i64, L))
                with f.if_(b.icmp_signed("<", kfull, kc)):
                    block(kfull, b.sub(kc, kfull))

        if mr % L == 0 and mr > L:  # equal groups: a run-time loop, one transpose emitted
            with f.for_range(0, mr, step=L, name="rg") as rg:
                group(rg, L)
        else:
            for rg in range(0, mr, L):
                group(const(i64, rg), min(L, mr - rg))
    return f.finish()


def _splat_i1(b: ir.IRBuilder, bit: ir.Value, lanes: int) -> ir.Value:
    vt = ir.VectorType(ir.IntType(1), lanes)
    v = b.insert_element(ir.Constant(vt, ir.Undefined), bit, ir.Constant(ir.IntType(32), 0))
    return b.shuffle_vector(v, ir.Constant(vt, ir.Undefined),
                            ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
