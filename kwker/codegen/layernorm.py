"""LayerNorm: ``out = (x - mean) / sqrt(var + eps) * w + b`` over each row of ``d`` elements;
RMSNorm (``spec.norm``): ``x / sqrt(mean(x^2) + eps) * w``, the same sweeps without the mean.

Contract: ``rows`` contiguous rows of ``spec.dtype`` (float32, or bfloat16 widened to float32)
in, the same out (or ``spec.out``: bf16 out of float32 rows, the float32 result rounded once,
as the cast autocast puts after a float32 norm rounds it); ``w`` and ``b`` are float32 (either
may be absent). Maths in float32, no fast-math flags:

- mean and biased variance in two passes over the row (L1-resident up to a few thousand
  elements): ``m0 = sum(x) / d``, then the deviations ``e = x - m0`` summed and squared. The
  rounding of ``m0`` (large for a row far from 0, e.g. ``x + 1000``) is corrected with the sum
  of ``e`` (the corrected two-pass algorithm of Chan, Golub and LeVeque):
  ``mean = m0 + sum(e)/d``, ``var = sum(e^2)/d - (sum(e)/d)^2``, at least as accurate as
  ATen's Welford (measured), without its serial dependency. ``rstd = 1 / sqrt(var + eps)``
  (``llvm.sqrt``: exact).
- the output: float32 ``fma(((x - m0) - sum(e)/d) * rstd, w, b)``, ATen's
  ``fma((x - mean) * rstd, w, b)`` (its compiler fuses the multiply-add) without first rounding
  the mean to float32, which rows far from 0 would pay (``x - m0`` is exact near the mean).
  bfloat16: ATen's ``fma(fma(x, rstd, -rstd * mean), w, b)``, rounded once to bf16
  (codegen/bf16.py): given ATen's own mean and rstd, bit for bit ATen's output (measured, torch
  2.13, AVX-512 ATen kernels). An absent w is 1 and an absent b is +0 (so no -0 comes out, as
  in ATen).

Each reduction keeps UNROLL vector accumulators (one chain would wait on the add latency, not
on the loads). ``d`` is compiled in: the row is UNROLL-vector groups in a loop, then the
leftover vectors and one masked vector for ``d % lanes`` (masked-off lanes load 0 and are kept
out of the deviation sums), no scalar loop. A row holding inf or NaN comes out all NaN, as in
ATen; unlike ATen's running mean, ``sum(x)`` overflows for values beyond ~FLT_MAX / d.

Rows are split into contiguous ranges over torch's OpenMP pool, at most one thread per GRAIN
elements, so a small call (one row of 384 when decoding a token) runs without a fork. ``rows
== 0`` is the generic kernel ``sym(x, w, b, out, rows, nthreads)``: the row count and the
thread cap are read at call time; otherwise ``sym(x, w, b, out, nthreads)``.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, omp, simd, vmath
from .irutil import const, f32, i16, i64, new_module, ptr

UNROLL = 4
# elements per thread: a fork/join costs ~1.5 us, and a second thread starts to pay from ~10K
# float32 / ~5K bf16 elements (measured on a 2-core Zen 4, rows of 128 to 2048; bf16 costs about
# twice as much per element, its widening and rounding included)
GRAIN = {"f32": 8192, "bf16": 4096}


def _sweep(fn, d: int, lanes: int, visit) -> None:
    """``visit(index, slot, active)`` for every vector of a ``d``-element row: ``index`` its
    first element, ``slot`` the accumulator it feeds (< UNROLL), ``active`` its lanes in use."""
    b = fn.b
    full, tail = divmod(d, lanes)
    groups = full // UNROLL
    if groups:
        with fn.for_range(0, groups, name="group") as g:
            at = b.mul(g, const(i64, UNROLL * lanes))
            for u in range(UNROLL):
                visit(b.add(at, const(i64, u * lanes)), u, lanes)
    for v in range(groups * UNROLL, full):
        visit(const(i64, v * lanes), v % UNROLL, lanes)
    if tail:
        visit(const(i64, full * lanes), full % UNROLL, tail)


def _total(b, accs) -> ir.Value:
    """Sum of the lanes of every accumulator: a tree over the vectors, then over the lanes."""
    vs = [a.get() for a in accs]
    while len(vs) > 1:
        vs = [b.fadd(vs[i], vs[i + 1]) if i + 1 < len(vs) else vs[i]
              for i in range(0, len(vs), 2)]
    return simd.hsum(b, vs[0])


def _rms_row(fn, spec, lanes: int, xrow, orow, w) -> None:
    """RMSNorm: ``x * (1 / sqrt(sum(x^2) / d + eps)) * w`` (``rms_hf``: the product before ``w``
    rounded to x's dtype first, as transformers computes it)."""
    b, d, dtype = fn.b, spec.d, spec.dtype
    vt = simd.vty(lanes)
    zero = vmath.splat(vt, 0.0)
    sqs = [fn.var(vt, zero, f"sq{k}") for k in range(min(UNROLL, -(-d // lanes)))]

    def square(i, k, active):
        x = bf16.load_as(b, dtype, xrow, i, lanes, active)
        sqs[k].set(vmath.fma(b, x, x, sqs[k].get()))

    _sweep(fn, d, lanes, square)
    ms = b.fdiv(_total(b, sqs), const(f32, float(d)), name="ms")
    root = fn.call_intrinsic("llvm.sqrt.f32", f32, [b.fadd(ms, const(f32, spec.eps))])
    rv = simd.broadcast(b, b.fdiv(const(f32, 1.0), root, name="rstd"), lanes)

    def write(i, k, active):
        y = b.fmul(bf16.load_as(b, dtype, xrow, i, lanes, active), rv)
        if dtype == "bf16" and spec.norm == "rms_hf":
            y = bf16.widen(b, bf16.narrow(b, y))
        if spec.weight:
            y = b.fmul(simd.load_any(b, w, i, lanes, active), y)
        bf16.store_as(b, spec.out or dtype, y, orow, i, active)

    _sweep(fn, d, lanes, write)


def _row(fn, spec, lanes: int, xrow, orow, w, bias) -> None:
    if spec.norm != "layer":
        return _rms_row(fn, spec, lanes, xrow, orow, w)
    b, d, dtype = fn.b, spec.d, spec.dtype
    vt = simd.vty(lanes)
    zero = vmath.splat(vt, 0.0)
    nd = const(f32, float(d))
    nacc = min(UNROLL, -(-d // lanes))

    def load(i, active):
        return bf16.load_as(b, dtype, xrow, i, lanes, active)

    sums = [fn.var(vt, zero, f"sum{k}") for k in range(nacc)]

    def add(i, k, active):
        sums[k].set(b.fadd(sums[k].get(), load(i, active)))

    _sweep(fn, d, lanes, add)
    m0 = b.fdiv(_total(b, sums), nd, name="m0")
    m0v = simd.broadcast(b, m0, lanes)
    devs = [fn.var(vt, zero, f"dev{k}") for k in range(nacc)]
    sqs = [fn.var(vt, zero, f"sq{k}") for k in range(nacc)]

    def deviate(i, k, active):
        e = b.fsub(load(i, active), m0v)
        if active < lanes:
            e = b.select(simd.const_mask(lanes, active), e, zero)
        devs[k].set(b.fadd(devs[k].get(), e))
        sqs[k].set(vmath.fma(b, e, e, sqs[k].get()))

    _sweep(fn, d, lanes, deviate)
    shift = b.fdiv(_total(b, devs), nd, name="shift")
    var = b.fsub(b.fdiv(_total(b, sqs), nd), b.fmul(shift, shift), name="var")
    # rounding can leave a constant row's variance a hair below 0; NaN must pass through
    var = b.select(b.fcmp_ordered("<", var, const(f32, 0.0)), const(f32, 0.0), var)
    root = fn.call_intrinsic("llvm.sqrt.f32", f32, [b.fadd(var, const(f32, spec.eps))])
    rstd = b.fdiv(const(f32, 1.0), root, name="rstd")
    rv = simd.broadcast(b, rstd, lanes)
    if dtype == "f32":  # (x - m0) - shift: x - m0 is exact near the mean, so the mean's
        shv = simd.broadcast(b, shift, lanes)  # rounding to float32 is never paid
    else:  # ATen's bf16 form, with the mean rounded as ATen has it
        mean = b.fadd(m0, shift, name="mean")
        nbv = simd.broadcast(b, b.fmul(b.fneg(rstd), mean), lanes)

    def write(i, k, active):
        x = load(i, active)
        if dtype == "f32":
            t = b.fmul(b.fsub(b.fsub(x, m0v), shv), rv)
        else:
            t = vmath.fma(b, x, rv, nbv)
        off = simd.load_any(b, bias, i, lanes, active) if spec.bias else zero
        if spec.weight:
            y = vmath.fma(b, t, simd.load_any(b, w, i, lanes, active), off)
        else:
            y = b.fadd(t, off)
        bf16.store_as(b, spec.out or dtype, y, orow, i, active)

    _sweep(fn, d, lanes, write)


def emit(spec, target) -> ir.Module:
    if spec.dtype not in ("f32", "bf16"):
        raise ValueError(f"kwker: layernorm dtype {spec.dtype!r}; have ['bf16', 'f32']")
    if spec.norm not in ("layer", "rms", "rms_hf") or spec.norm != "layer" and spec.bias:
        raise ValueError(f"kwker: norm {spec.norm!r} (layer, or rms / rms_hf without a bias)")
    if spec.d < 1 or spec.rows < 0:
        raise ValueError(f"kwker: layernorm needs d >= 1 and rows >= 0, got {spec}")
    if spec.out not in ("", spec.dtype) and (spec.dtype, spec.out) != ("f32", "bf16"):
        raise ValueError(f"kwker: a {spec.out} output of a {spec.dtype} norm")
    lanes = simd.float_lanes(target)
    elem = i16 if spec.dtype == "bf16" else f32
    module = new_module(spec.symbol)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    b = body.b
    x, w, bias, out = (ctx.ptr(slot) for slot in range(4))
    rows = ctx.i64(4) if spec.rows == 0 else const(i64, spec.rows)
    begin, end = omp.split(body, rows, body.args[1], body.args[2])
    with body.for_range(begin, end, name="row") as r:
        at = b.mul(r, const(i64, spec.d))
        out_elem = i16 if (spec.out or spec.dtype) == "bf16" else f32
        _row(body, spec, lanes, simd.gep(b, x, at, elem), simd.gep(b, out, at, out_elem), w,
             bias)
    body.finish()
    grain = GRAIN[spec.dtype]
    if spec.rows:
        omp.emit_parallel(module, spec.symbol, [ptr] * 4, body.fn,
                          max_threads=max(1, spec.rows * spec.d // grain))
    else:  # the same cap, from the rows argument
        omp.emit_parallel(module, spec.symbol, [ptr] * 4 + [i64], body.fn,
                          lambda b, args: omp.per_grain(b, b.mul(args[4], const(i64, spec.d)),
                                                        grain))
    return module
