"""Packing routines of the GEMM: operands copied into the layouts the micro-kernel streams.

- ``A`` micro-panels (``pack_rows``): rows ``[0, rows)`` x ``kc`` columns of a row-major matrix
  become tiles of ``mr`` rows stored k-major, ``dst[t][k][r]`` (``mr`` consecutive floats per k,
  the broadcasts of one k step share a cache line). Rows past ``rows`` are zero, so an edge tile
  computes garbage-free zeros and the kernel only has to skip storing them. The same routine packs
  a transposed B (``(n, k)`` row-major) into N panels.
- ``B`` panels from a row-major ``(k, n)`` matrix (``pack_cols``): ``nr``-wide column strips,
  ``dst[q][k][j]``, zero-padded past column ``cols``; whole-vector copies, masked at the edge.

Weights of ``linear`` are packed once, at build time, by the factory in the same panel layout.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, f32, i64, ptr, void


def emit_pack_rows(module: ir.Module, mr: int, ld: int) -> ir.Function:
    """``void pack_rows(ptr src, i64 rows, i64 kc, ptr dst)``: tiles of ``mr`` rows, k-major.

    ``src`` points at element (0, k0) of a row-major matrix with row stride ``ld``.
    """
    name = f"pack_rows.{mr}.{ld}"
    try:
        return module.get_global(name)
    except KeyError:
        pass
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


def emit_pack_cols(module: ir.Module, nr: int, ld: int, lanes: int) -> ir.Function:
    """``void pack_cols(ptr src, i64 cols, i64 kc, ptr dst)``: ``nr``-wide panels, k-major.

    ``src`` points at element (k0, 0) of a row-major ``(k, n)`` matrix with row stride ``ld``.
    """
    name = f"pack_cols.{nr}.{ld}.{lanes}"
    try:
        return module.get_global(name)
    except KeyError:
        pass
    f = Fn(module, name, void, [ptr, i64, i64, ptr], ["src", "cols", "kc", "dst"])
    f.fn.attributes.add("noinline")
    src, cols, kc, dst = f.args
    b = f.b
    nv = nr // lanes
    panels = b.sdiv(b.add(cols, const(i64, nr - 1)), const(i64, nr))
    with f.for_range(0, panels, name="q") as q:
        col0 = b.mul(q, const(i64, nr))
        pdst = b.mul(q, b.mul(kc, const(i64, nr)))
        masks = []
        for v in range(nv):
            masks.append(simd.lane_mask(b, lanes, b.sub(cols, b.add(col0, const(i64, v * lanes)))))
        with f.for_range(0, kc, name="k") as k:
            sbase = b.add(b.mul(k, const(i64, ld)), col0)
            dbase = b.add(pdst, b.mul(k, const(i64, nr)))
            for v in range(nv):
                x = simd.masked_load(b, src, b.add(sbase, const(i64, v * lanes)), masks[v], lanes)
                simd.store_vec(b, x, dst, b.add(dbase, const(i64, v * lanes)))
    return f.finish()
