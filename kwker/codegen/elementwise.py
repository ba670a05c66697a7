"""Elementwise kernels: GELU (erf and tanh forms), ReLU, SiLU, exp, erf, tanh; SiLU * y.

Contract: ``out[i] = op(x[i])`` for a contiguous buffer of ``numel`` elements (in place allowed)
of ``spec.dtype``: float32, or bfloat16 widened to float32, computed in float32 and rounded once
to bf16 on store (ATen's round-to-nearest-even, ``codegen/bf16.py``), as ATen computes bf16 GELU.
Each thread takes a contiguous, vector-aligned share; the body runs ``UNROLL[op]`` vectors per
iteration (cheap ops are unrolled; the polynomial ones are not: their constants would spill),
then single vectors, then one masked vector for the tail (no scalar loop). The maths is
``codegen/vmath.py`` (vectorised, ~1 ulp, no libm calls); no fast-math flags.

``numel == 0`` is the generic kernel ``sym(src, dst, numel, nthreads)``: the same loops with the
size, the thread split and the thread cap read at call time, so one compile serves every size.

``spec.rows`` (binary ops): ``sym(x, y, out, rows, width, ldx, ldy, nthreads)`` over rows whose
x and y lie ``ldx`` / ``ldy`` elements apart (the two halves of ``t.chunk(2, -1)``: Phi-3's
fused gate and up projection), out contiguous; threads take whole rows.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, omp, simd, vmath
from .irutil import const, i64, new_module, ptr

# elements per thread below which a fork (~1 us) costs more than it saves: the polynomial ops
# spend ~1 ns per element, a ReLU mostly moves memory
GRAIN = {"relu": 1 << 15}  # others: DEFAULT_GRAIN
DEFAULT_GRAIN = 1 << 12
UNROLL = {"relu": 4}  # others: 1

# op(b, x, avx512): ``avx512`` lets the exp-based ops scale with vscalefps (vmath.exp)
OPS = {
    "silu": vmath.silu,
    "gelu": lambda b, x, avx512: vmath.gelu(b, x, "none"),
    "gelu_tanh": lambda b, x, avx512: vmath.gelu(b, x, "tanh"),
    "relu": lambda b, x, avx512: vmath.relu(b, x),
    "exp": vmath.exp,
    "erf": lambda b, x, avx512: vmath.erf(b, x),
    "tanh": vmath.tanh,
}


def _load_f32(b, base, index, lanes, mask=None):
    if mask is None:
        return simd.load_vec(b, base, index, lanes)
    return simd.masked_load(b, base, index, mask, lanes)


def _store_f32(b, x, base, index, mask=None):
    if mask is None:
        simd.store_vec(b, x, base, index)
    else:
        simd.masked_store(b, x, base, index, mask)


def _load_bf16(b, base, index, lanes, mask=None):
    return bf16.load(b, base, index, lanes, mask=mask)


def _store_bf16(b, x, base, index, mask=None):
    bf16.store(b, x, base, index, mask=mask)


# (load, store) per element type: float32 lanes in registers either way, bf16 as i16 in memory,
# rounded as ATen rounds (bf16.narrow; vcvtneps2bf16 flushes denormals and keeps NaN payloads)
IO = {"f32": (_load_f32, _store_f32), "bf16": (_load_bf16, _store_bf16)}


# binary ops: ``out = OPS[first](a) * b`` (SwiGLU's ``silu(gate) * up``); bf16 rounds the first
# op's result before the product, as eager runs the two ops
BINARY = {"silu_mul": "silu"}


def _emit_rows(spec, target, module, load, store) -> ir.Module:
    """The row-strided binary kernel (module doc)."""
    lanes, avx512 = simd.float_lanes(target), target.has("avx512f")
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    b = body.b
    x, y, out = (ctx.ptr(i) for i in range(3))
    rows, width, ldx, ldy = (ctx.i64(3 + i) for i in range(4))
    first = OPS[BINARY[spec.op]]
    r0, r1 = omp.split(body, rows, body.args[1], body.args[2])
    full = b.mul(b.sdiv(width, const(i64, lanes)), const(i64, lanes))
    tail = b.sub(width, full)

    def one(xr, yr, orow, at, mask=None):
        v = first(b, load(b, xr, at, lanes, mask), avx512)
        if spec.dtype == "bf16":
            v = bf16.widen(b, bf16.narrow(b, v))
        store(b, b.fmul(v, load(b, yr, at, lanes, mask)), orow, at, mask)

    with body.for_range(r0, r1, name="r") as r:
        et = ir.IntType(16) if spec.dtype == "bf16" else ir.FloatType()
        xr = simd.gep(b, x, b.mul(r, ldx), et)
        yr = simd.gep(b, y, b.mul(r, ldy), et)
        orow = simd.gep(b, out, b.mul(r, width), et)
        with body.for_range(0, full, step=lanes, name="c") as c:
            one(xr, yr, orow, c)
        with body.if_(b.icmp_signed(">", tail, const(i64, 0))):
            one(xr, yr, orow, full, simd.lane_mask(b, lanes, tail))
    body.finish()
    grain = GRAIN.get(spec.op, DEFAULT_GRAIN)
    omp.emit_parallel(module, spec.symbol, [ptr] * 3 + [i64] * 4, body.fn,
                      lambda b, args: omp.per_grain(b, b.mul(args[3], args[4]), grain))
    return module


def emit(spec, target) -> ir.Module:
    if spec.op not in OPS and spec.op not in BINARY:
        raise ValueError(f"kwker: no elementwise op {spec.op!r}; have "
                         f"{sorted(OPS) + sorted(BINARY)}")
    if spec.dtype not in IO:
        raise ValueError(f"kwker: elementwise dtype {spec.dtype!r}; have {sorted(IO)}")
    lanes, avx512 = simd.float_lanes(target), target.has("avx512f")
    load, store = IO[spec.dtype]
    arity = 2 if spec.op in BINARY else 1
    module = new_module(spec.symbol)
    if spec.rows:
        if arity != 2 or spec.numel:
            raise ValueError("kwker: row-strided elementwise kernels are binary and generic")
        return _emit_rows(spec, target, module, load, store)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    tid, nt = body.args[1], body.args[2]
    b = body.b
    src, dst = ctx.ptr(0), ctx.ptr(arity)
    if arity == 1:
        unary = OPS[spec.op]

        def op(b, x, at, mask=None):
            return unary(b, x, avx512)
    else:
        first, other = OPS[BINARY[spec.op]], ctx.ptr(1)

        def op(b, x, at, mask=None):
            y = first(b, x, avx512)
            if spec.dtype == "bf16":
                y = bf16.widen(b, bf16.narrow(b, y))
            return b.fmul(y, load(b, other, at, lanes, mask))
    if spec.numel:
        numel = const(i64, spec.numel)
        vecs = (spec.numel + lanes - 1) // lanes
    else:
        numel = ctx.i64(arity + 1)
        vecs = b.udiv(b.add(numel, const(i64, lanes - 1)), const(i64, lanes))
    vbegin, vend = omp.split(body, vecs, tid, nt)
    begin = b.mul(vbegin, const(i64, lanes))
    end = b.mul(vend, const(i64, lanes))
    end = b.select(b.icmp_signed(">", end, numel), numel, end)
    i = body.var(i64, begin, "i")
    unroll = UNROLL.get(spec.op, 1)
    step = lanes * unroll
    with body.while_(lambda: b.icmp_signed("<=", b.add(i.get(), const(i64, step)), end)):
        base = i.get()
        ats = [b.add(base, const(i64, u * lanes)) for u in range(unroll)]
        xs = [load(b, src, at, lanes) for at in ats]
        for at, x in zip(ats, xs):
            store(b, op(b, x, at), dst, at)
        i.set(b.add(base, const(i64, step)))
    with body.while_(lambda: b.icmp_signed("<=", b.add(i.get(), const(i64, lanes)), end)):
        base = i.get()
        store(b, op(b, load(b, src, base, lanes), base), dst, base)
        i.set(b.add(base, const(i64, lanes)))
    rest = b.sub(end, i.get())
    with body.if_(b.icmp_signed(">", rest, const(i64, 0))):
        mask = simd.lane_mask(b, lanes, rest)
        at = i.get()
        store(b, op(b, load(b, src, at, lanes, mask), at, mask), dst, at, mask)
    body.finish()
    grain = GRAIN.get(spec.op, DEFAULT_GRAIN)
    if spec.numel:
        omp.emit_parallel(module, spec.symbol, [ptr] * (arity + 1), body.fn,
                          max_threads=max(1, spec.numel // grain))
    else:  # the same cap, from the numel argument
        omp.emit_parallel(module, spec.symbol, [ptr] * (arity + 1) + [i64], body.fn,
                          lambda b, args: omp.per_grain(b, args[arity + 1], grain))
    return module
