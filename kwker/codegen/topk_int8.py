"""int8 screening for the fused scoring + top-k at few rows (``approx="int8"``).

At one to four query rows the screening is bound by the bytes it reads, not by arithmetic: int8
weights (one byte per weight, a float32 scale per column) halve what bf16 reads. Each query row
is quantised per call (``emit_pack_int8``), the approximate scores come from ``vpdpbusd``
(``emit_micro_int8``, AVX512_VNNI: every CPU with AVX512_BF16 has it), and a column passes
the screen unless its approximation plus a rigorous bound of the error (derived in
``emit_pack_int8``) falls short of the row's heap root. Survivors are rescored in float32 as the
other paths rescore them, so the results are exact.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, defined, f32, i32, i64, intrinsic, ptr, void


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAX_INT8_K = 1024  # |q8 . w8| <= K 127^2 must stay below 2^24 (exact in float32)
I32x16 = ir.VectorType(i32, 16)
F64 = ir.DoubleType()


def emit_micro_int8(module: ir.Module, mr: int, nv: int, nr: int, kq: int) -> ir.Function:
    """``void ukq(ptr a, ptr b, ptr c)``: C[mr x nr] (int32) = A B over ``kq`` k quads with
    ``vpdpbusd``: ``a`` words ``a[p * mr + r]`` (4 signed bytes), ``b`` panel words
    ``b[p * nr + j]`` (4 unsigned bytes). Few accumulators: k split into partial sums."""
    split = 2 if mr * nv <= 4 and kq % 2 == 0 else 1
    name = f"ukq.{mr}x{nv}.{nr}.{kq}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, ptr, ptr], ["a", "b", "c"])
    f.fn.attributes.add("noinline")
    a, bp, c = f.args
    b = f.b
    dp = intrinsic(module, "llvm.x86.avx512.vpdpbusd.512", I32x16, [I32x16] * 3)
    zero = ir.Constant(I32x16, [0] * 16)
    acc = [[[f.var(I32x16, zero, f"acc{h}_{r}_{v}") for v in range(nv)] for r in range(mr)]
           for h in range(split)]
    with f.for_range(0, kq // split, name="p") as p0:
        for h in range(split):
            p = b.add(b.mul(p0, const(i64, split)), const(i64, h))
            row = b.mul(p, const(i64, nr))
            bv = [b.load(simd.gep(b, bp, b.add(row, const(i64, 16 * v)), i32), typ=I32x16,
                         align=4) for v in range(nv)]
            for r in range(mr):
                word = simd.load_scalar(b, a, b.add(b.mul(p, const(i64, mr)), const(i64, r)), i32)
                av = simd.broadcast(b, word, 16)
                for v in range(nv):
                    acc[h][r][v].set(b.call(dp, [acc[h][r][v].get(), bv[v], av]))
    for r in range(mr):
        for v in range(nv):
            total = acc[0][r][v].get()
            for h in range(1, split):
                total = b.add(total, acc[h][r][v].get())
            b.store(total, simd.gep(b, c, const(i64, r * nr + 16 * v), i32), align=4)
    return f.finish()


def emit_pack_int8(module: ir.Module, mr: int, k: int) -> ir.Function:
    """``void pack_int8(ptr x, i64 rows, ptr dst, ptr qinfo)``: rows of a (rows, k) float32
    matrix quantised to q8 = round(x / t) in [-127, 127], t = max(max|x|/127, 2^-100), packed
    as ``mr``-row tiles of 4-byte words ``dst[p * mr + r]`` (zero past ``rows`` and ``k``), and
    per row ``qinfo[4 r ..]`` = (t, alpha, beta, 128 sum q8 as int32).

    The bound: with q^ = t q8 and w^_j = s_j w8_j (as reals), the float32 rescored score s'
    (emit_dot) and approx = fl(fl(D s_j) t) obey
    |s' - approx| <= |q| |w - w^| + |q - q^| |w^| + g |q| |w| + 2^-23 |q^| |w^| + underflow,
    g = 1.01 K 2^-24 (the float32 dot product); with |w| <= E1 + E2, |q^| <= |q| + |q - q^|:
    <= alpha E1 + beta E2 + slack, alpha = |q| (1 + g), beta = |q - q^| (1 + 2^-22) +
    |q| (g + 2^-22), each rounded up with 2^-20 to spare for the float32 evaluation; norms
    are summed in float64 (no underflow), and (K + 64) 2^-122 covers underflow and flushing
    (every stored factor is a normal float). |q| > 2^60, inf or NaN: alpha is NaN and every
    lane passes. s' > root implies fl(approx + e) > root: rounding is monotone."""
    name = f"pack_int8.{mr}.{k}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr, ptr], ["x", "rows", "dst", "qinfo"])
    f.fn.attributes.add("noinline")
    x, rows, dst, qinfo = f.args
    b = f.b
    kq = _cdiv(k, 4)
    g = 1.01 * k * 2.0 ** -24
    zero64 = ir.Constant(F64, 0.0)
    with f.for_range(0, mr, name="r") as r:
        real = b.icmp_signed("<", r, rows)
        with f.if_else(real) as (yes, no):
            with yes:
                xr = simd.gep(b, x, b.mul(r, const(i64, k)))
                amax = f.var(f32, ir.Constant(f32, 0.0), "amax")
                ss = f.var(F64, zero64, "ss")
                with f.for_range(0, k, name="i") as i:
                    xi = simd.load_scalar(b, xr, i)
                    ax = f.call_intrinsic("llvm.fabs.f32", f32, [xi])
                    amax.set(b.select(b.fcmp_ordered(">", ax, amax.get()), ax, amax.get()))
                    xd = b.fpext(xi, F64)
                    ss.set(b.fadd(ss.get(), b.fmul(xd, xd)))
                t = b.fdiv(amax.get(), ir.Constant(f32, 127.0))
                t = b.select(b.fcmp_ordered("<", t, ir.Constant(f32, 2.0 ** -100)),
                             ir.Constant(f32, 2.0 ** -100), t)
                inv = b.fdiv(ir.Constant(f32, 1.0), t)
                t64 = b.fpext(t, F64)
                dd = f.var(F64, zero64, "dd")
                csum = f.var(i32, const(i32, 0), "csum")

                def quant(idx):
                    xi = simd.load_scalar(b, xr, idx)
                    v = f.call_intrinsic("llvm.rint.f32", f32, [b.fmul(xi, inv)])
                    v = f.call_intrinsic("llvm.maxnum.f32", f32, [v, ir.Constant(f32, -127.0)])
                    v = f.call_intrinsic("llvm.minnum.f32", f32, [v, ir.Constant(f32, 127.0)])
                    qi = b.fptosi(v, i32)
                    diff = b.fsub(b.fpext(xi, F64), b.fmul(t64, b.sitofp(qi, F64)))
                    dd.set(b.fadd(dd.get(), b.fmul(diff, diff)))
                    csum.set(b.add(csum.get(), qi))
                    return b.and_(qi, const(i32, 255))

                def store_word(p, idxs):
                    word = const(i32, 0)
                    for j, idx in enumerate(idxs):
                        word = b.or_(word, b.shl(quant(idx), const(i32, 8 * j)))
                    simd.store_scalar(b, word, dst, b.add(b.mul(p, const(i64, mr)), r))

                with f.for_range(0, k // 4, name="p") as p:
                    store_word(p, [b.add(b.mul(p, const(i64, 4)), const(i64, j))
                                   for j in range(4)])
                if k % 4:
                    store_word(const(i64, k // 4), [const(i64, 4 * (k // 4) + j)
                                                    for j in range(k % 4)])
                qn = f.call_intrinsic("llvm.sqrt.f64", F64, [ss.get()])
                dn = f.call_intrinsic("llvm.sqrt.f64", F64, [dd.get()])

                def up(v):  # float32 >= v (v >= 0, not NaN), never subnormal
                    v = b.fmul(v, ir.Constant(F64, 1 + 2.0 ** -20))
                    v = f.call_intrinsic("llvm.maxnum.f64", F64, [v, ir.Constant(F64, 2.0 ** -126)])
                    return b.fptrunc(v, f32)

                alpha = up(b.fmul(qn, ir.Constant(F64, 1 + g)))
                beta = up(b.fadd(b.fmul(dn, ir.Constant(F64, 1 + 2.0 ** -22)),
                                 b.fmul(qn, ir.Constant(F64, g + 2.0 ** -22))))
                ok = b.fcmp_ordered("<=", qn, ir.Constant(F64, 2.0 ** 60))
                alpha = b.select(ok, alpha, ir.Constant(f32, float("nan")))
                info = simd.gep(b, qinfo, b.mul(r, const(i64, 4)))
                for j, val in enumerate((t, alpha, beta)):
                    simd.store_scalar(b, val, info, const(i64, j))
                simd.store_scalar(b, b.mul(csum.get(), const(i32, 128)), info, const(i64, 3))
            with no, f.for_range(0, kq, name="z") as p:
                simd.store_scalar(b, const(i32, 0), dst, b.add(b.mul(p, const(i64, mr)), r))
    return f.finish()
