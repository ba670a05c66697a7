"""Elementwise float32 kernels: GELU (erf and tanh forms), ReLU, exp, erf, tanh.

Contract: ``out[i] = op(x[i])`` for a contiguous buffer of ``numel`` floats (in place allowed).
Each thread takes a contiguous, vector-aligned share; the body runs ``UNROLL[op]`` vectors per
iteration (cheap ops are unrolled; the polynomial ones are not: their constants would spill),
then single vectors, then one masked vector for the tail (no scalar loop). The maths is
``codegen/vmath.py`` (vectorised, ~1 ulp, no libm calls); no fast-math flags.
"""
from __future__ import annotations

from llvmlite import ir

from . import omp, simd, vmath
from .irutil import const, i64, new_module, ptr

# elements per thread below which a fork (~1 us) costs more than it saves: the polynomial ops
# spend ~1 ns per element, a ReLU mostly moves memory
GRAIN = {"relu": 1 << 15}  # others: DEFAULT_GRAIN
DEFAULT_GRAIN = 1 << 12
UNROLL = {"relu": 4}  # others: 1

OPS = {
    "gelu": lambda b, x: vmath.gelu(b, x, "none"),
    "gelu_tanh": lambda b, x: vmath.gelu(b, x, "tanh"),
    "relu": vmath.relu,
    "exp": vmath.exp,
    "erf": vmath.erf,
    "tanh": vmath.tanh,
}


def emit(spec, target) -> ir.Module:
    if spec.op not in OPS:
        raise ValueError(f"kwker: no elementwise op {spec.op!r}; have {sorted(OPS)}")
    op = OPS[spec.op]
    lanes = simd.float_lanes(target)
    module = new_module(spec.symbol)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    tid, nt = body.args[1], body.args[2]
    b = body.b
    src, dst = ctx.ptr(0), ctx.ptr(1)
    vecs = (spec.numel + lanes - 1) // lanes
    vbegin, vend = omp.split(body, vecs, tid, nt)
    begin = b.mul(vbegin, const(i64, lanes))
    end = b.mul(vend, const(i64, lanes))
    end = b.select(b.icmp_signed(">", end, const(i64, spec.numel)), const(i64, spec.numel), end)
    i = body.var(i64, begin, "i")
    unroll = UNROLL.get(spec.op, 1)
    step = lanes * unroll
    with body.while_(lambda: b.icmp_signed("<=", b.add(i.get(), const(i64, step)), end)):
        base = i.get()
        xs = [simd.load_vec(b, src, b.add(base, const(i64, u * lanes)), lanes)
              for u in range(unroll)]
        for u, x in enumerate(xs):
            simd.store_vec(b, op(b, x), dst, b.add(base, const(i64, u * lanes)))
        i.set(b.add(base, const(i64, step)))
    with body.while_(lambda: b.icmp_signed("<=", b.add(i.get(), const(i64, lanes)), end)):
        base = i.get()
        simd.store_vec(b, op(b, simd.load_vec(b, src, base, lanes)), dst, base)
        i.set(b.add(base, const(i64, lanes)))
    rest = b.sub(end, i.get())
    with body.if_(b.icmp_signed(">", rest, const(i64, 0))):
        mask = simd.lane_mask(b, lanes, rest)
        x = simd.masked_load(b, src, i.get(), mask, lanes)
        simd.masked_store(b, op(b, x), dst, i.get(), mask)
    body.finish()
    max_threads = max(1, spec.numel // GRAIN.get(spec.op, DEFAULT_GRAIN))
    omp.emit_parallel(module, spec.symbol, [ptr, ptr], body.fn, max_threads=max_threads)
    return module
