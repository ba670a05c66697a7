"""bf16 screening for the fused top-k: approximate scores at twice the FMA rate, with a bound.

On CPUs with AVX512_BF16, ``vdpbf16ps`` multiplies pairs of bf16 and accumulates in float32: 32
multiply-adds per instruction, twice ``vfmadd231ps``. The fused top-k uses it only to *discard*
scores that cannot enter a heap; every score that may enter is recomputed exactly in float32
(``emit_dot``), so results and tie order are those of the float32 scores.

The bound. With bf16 rounding (unit roundoff u = 2^-8) of both operands,
``|q.w - q^.w^| <= (2u + u^2) sum|q_i||w_i| <= (2u + u^2) |q| |w|`` (Cauchy-Schwarz), plus the
float32 accumulation errors of both dot products (K * 2^-24 |q| |w| each). The factory stores
``e_j = c |w_j|`` rounded up; the kernel multiplies by ``|q|`` rounded up and adds what flushing
denormals can cost, ``2^-126 K (|w| + |q| + 1)``. An element can only beat the heap root if
``approx + bound > root`` (largest) or ``approx - bound < root``; NaN always passes.

Layouts: B panels of ``nr`` columns hold, per pair of k, one 32-bit word (two bf16) per column,
so one zmm is 16 columns x 2 k; A rows are packed the same way, one word per (k pair, row).
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, defined, f32, i16, i32, i64, intrinsic, ptr, void
from .vmath import fma

I16x32 = ir.VectorType(i16, 32)
I32x16 = ir.VectorType(i32, 16)
F32x16 = ir.VectorType(f32, 16)


def bound_factor(k: int) -> float:
    """c in e_j = c |w_j|: bf16 rounding of both operands plus two float32 accumulations."""
    u = 2.0 ** -8
    return (2 * u + u * u + 2 * k * 2.0 ** -24) * 1.01


def emit_micro_bf16(module: ir.Module, mr: int, nv: int, nr: int) -> ir.Function:
    """``void ukb(ptr a, ptr b, ptr c, i64 kp)``: C[mr x nr] = A B over ``kp`` k pairs.

    ``a``: packed words ``a[p * mr + r]``; ``b``: panel words ``b[p * nr + j]``; C row stride nr.
    """
    name = f"ukb.{mr}x{nv}.{nr}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, ptr, ptr, i64], ["a", "b", "c", "kp"])
    f.fn.attributes.add("noinline")
    a, bp, c, kp = f.args
    b = f.b
    dp = intrinsic(module, "llvm.x86.avx512bf16.dpbf16ps.512", F32x16, [F32x16, I16x32, I16x32])
    zero = ir.Constant(F32x16, [ir.Constant(f32, 0.0)] * 16)
    acc = [[f.var(F32x16, zero, f"acc{r}_{v}") for v in range(nv)] for r in range(mr)]
    with f.for_range(0, kp, name="p") as p:
        row = b.mul(p, const(i64, nr))
        bv = [b.bitcast(b.load(simd.gep(b, bp, b.add(row, const(i64, 16 * v)), i32), typ=I32x16,
                               align=4), I16x32) for v in range(nv)]
        abase = b.mul(p, const(i64, mr))
        for r in range(mr):
            word = simd.load_scalar(b, a, b.add(abase, const(i64, r)), i32)
            av = b.bitcast(simd.broadcast(b, word, 16), I16x32)
            for v in range(nv):
                acc[r][v].set(b.call(dp, [acc[r][v].get(), av, bv[v]]))
    for r in range(mr):
        for v in range(nv):
            simd.store_vec(b, acc[r][v].get(), c, const(i64, r * nr + 16 * v))
    return f.finish()


def _to_bf16(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """float32 -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN."""
    bits = b.bitcast(x, i32)
    nan = b.icmp_unsigned(">", b.and_(bits, const(i32, 0x7FFFFFFF)), const(i32, 0x7F800000))
    odd = b.and_(b.lshr(bits, const(i32, 16)), const(i32, 1))
    rounded = b.lshr(b.add(bits, b.add(const(i32, 0x7FFF), odd)), const(i32, 16))
    return b.select(nan, const(i32, 0x7FC0), rounded)


def emit_pack_bf16(module: ir.Module, mr: int, k: int, rows_of: int = 0) -> ir.Function:
    """``void pack_bf16(ptr x, i64 rows, ptr dst, ptr qnorm)``: rows of a (rows, k) float32
    matrix into ``mr``-row tiles of bf16 word pairs ``dst[t][p][r]`` (zero past ``rows`` and
    past ``k``), and ``qnorm[row]`` = |x_row| rounded up (float32 sum of squares, sqrt).
    ``rows_of``: row-major tiles instead, ``dst[t][r][p]`` with rows of ``rows_of`` words (the
    A tiles of AMX; zero past ``k``)."""
    name = f"pack_bf16.{mr}.{k}" + (f".r{rows_of}" if rows_of else "")
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr, ptr], ["x", "rows", "dst", "qnorm"])
    f.fn.attributes.add("noinline")
    x, rows, dst, qnorm = f.args
    b = f.b
    kp = (k + 1) // 2
    tiles = b.sdiv(b.add(rows, const(i64, mr - 1)), const(i64, mr))
    with f.for_range(0, b.mul(tiles, const(i64, mr)), name="r") as r:
        t = b.sdiv(r, const(i64, mr))
        rr = b.srem(r, const(i64, mr))
        if rows_of:   # row r of tile t at (t mr + r) rows_of, its pairs in a row
            base, p_step = b.mul(r, const(i64, rows_of)), 1
            with f.for_range(kp, rows_of, name="pz") as p:
                simd.store_scalar(b, const(i32, 0), dst, b.add(base, p))
        else:
            base, p_step = b.add(b.mul(t, const(i64, kp * mr)), rr), mr
        real = b.icmp_signed("<", r, rows)
        ss = f.var(f32, ir.Constant(f32, 0.0), "ss")
        with f.for_range(0, kp, name="p") as p:
            word = f.var(i32, const(i32, 0), "w")
            with f.if_(real):
                k0 = b.mul(p, const(i64, 2))
                x0 = simd.load_scalar(b, x, b.add(b.mul(r, const(i64, k)), k0))
                lo = _to_bf16(b, x0)
                ss.set(b.fadd(ss.get(), b.fmul(x0, x0)))
                hi = const(i32, 0)
                if k % 2 == 0:
                    x1 = simd.load_scalar(b, x, b.add(b.mul(r, const(i64, k)),
                                                      b.add(k0, const(i64, 1))))
                    ss.set(b.fadd(ss.get(), b.fmul(x1, x1)))
                    hi = _to_bf16(b, x1)
                else:
                    last = b.icmp_signed("==", p, const(i64, kp - 1))
                    x1i = b.select(last, k0, b.add(k0, const(i64, 1)))  # in bounds
                    x1 = simd.load_scalar(b, x, b.add(b.mul(r, const(i64, k)), x1i))
                    x1 = b.select(last, ir.Constant(f32, 0.0), x1)
                    ss.set(b.fadd(ss.get(), b.fmul(x1, x1)))
                    hi = _to_bf16(b, x1)
                word.set(b.or_(lo, b.shl(hi, const(i32, 16))))
            simd.store_scalar(b, word.get(), dst, b.add(base, b.mul(p, const(i64, p_step))))
        with f.if_(real):
            sq = f.call_intrinsic("llvm.sqrt.f32", f32, [ss.get()])
            slack = 1.0 + (k + 4) * 2.0 ** -24 + 2.0 ** -20
            simd.store_scalar(b, b.fmul(sq, ir.Constant(f32, slack)), qnorm, r)
    return f.finish()


def emit_dot(module: ir.Module, k: int, lanes: int) -> ir.Function:
    """``f32 dot(ptr x, ptr w)``: the float32 score of one (row, item) pair, computed the same
    way wherever it is needed (two vector accumulators, masked tail, tree sum)."""
    name = f"dot.{k}.{lanes}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, f32, [ptr, ptr], ["x", "w"])
    x, w = f.args
    b = f.b
    vt = simd.vty(lanes)
    zero = ir.Constant(vt, [ir.Constant(f32, 0.0)] * lanes)
    accs = [zero, zero]
    for i, j in enumerate(range(0, k, lanes)):
        active = min(lanes, k - j)
        xv = simd.load_any(b, x, j, lanes, active)
        wv = simd.load_any(b, w, j, lanes, active)
        accs[i % 2] = fma(b, xv, wv, accs[i % 2])
    f.ret(simd.hsum(b, b.fadd(accs[0], accs[1])))
    return f.finish()
