"""Rotary position embedding as transformers applies it: ``x * cos + rotate_half(x) * sin``.

``rotate_half(x) = cat(-x[..., h:], x[..., :h])`` with ``h = d / 2`` (Llama, Mistral, Qwen,
Gemma: ``apply_rotary_pos_emb``), so with ``x1, x2`` the halves of a row::

    out[:h] = x1 * cos[:h] + (-x2) * sin[:h]
    out[h:] = x2 * cos[h:] + x1 * sin[h:]

Eager runs it as seven ATen ops (two slices, a negation, a cat, two products and a sum, ~40 us
a layer in a decode step); here it is one pass over the rows. Each product and the sum are
rounded as ATen rounds them (float32: no fused multiply-add; bf16: each product rounded to bf16,
then the sum), so the result is ATen's bit for bit.

Contract: ``x`` is (B, H, T, d) with any strides but a contiguous last dim (q and k arrive as
transposes of the projection's output); ``cos`` and ``sin`` share one layout, broadcast over
any of B, H, T (stride 0) with a contiguous last dim; ``out`` likewise (the factory gives it
eager's layout). Sizes and strides (in elements) are read per call: one kernel per ``d`` and
dtype. ``spec.x`` "bf16" with float32 ``dtype``: bf16 rows of x (autocast's projections)
with float32 cos, sin and out, as ATen promotes them: x widened exactly, then float32 maths.
"""
from __future__ import annotations

from . import bf16, omp, simd
from .irutil import const, f32, i16, i64, new_module, ptr

GRAIN = 16384  # elements per thread: a decode step's few rows run on one


def emit(spec, target):
    if spec.dtype not in ("f32", "bf16"):
        raise ValueError(f"kwker: rope dtype {spec.dtype!r}; have ['bf16', 'f32']")
    if spec.d < 2 or spec.d % 2:
        raise ValueError(f"kwker: rope needs an even row length, got {spec.d}")
    if spec.x not in ("", spec.dtype) and (spec.x, spec.dtype) != ("bf16", "f32"):
        raise ValueError(f"kwker: rope of {spec.x} x with {spec.dtype} cos/sin")
    lanes = simd.float_lanes(target)
    elem = i16 if spec.dtype == "bf16" else f32
    x_dtype = spec.x or spec.dtype
    x_elem = i16 if x_dtype == "bf16" else f32
    d, half = spec.d, spec.d // 2
    module = new_module(spec.symbol)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    b = body.b
    x, cos, sin, out = (ctx.ptr(slot) for slot in range(4))
    rows, heads, seq = (ctx.i64(slot) for slot in (4, 5, 6))
    sx = [ctx.i64(slot) for slot in (7, 8, 9)]     # x's strides over B, H, T
    sc = [ctx.i64(slot) for slot in (10, 11, 12)]  # cos's and sin's
    so = [ctx.i64(slot) for slot in (13, 14, 15)]  # out's
    begin, end = omp.split(body, rows, body.args[1], body.args[2])
    dtype = spec.dtype

    def rounded(v):
        """A product as ATen leaves it: bf16 ops round each result to bf16."""
        return bf16.widen(b, bf16.narrow(b, v)) if dtype == "bf16" else v

    with body.for_range(begin, end, name="row") as r:
        t = b.srem(r, seq)
        bh = b.sdiv(r, seq)
        hh, bb = b.srem(bh, heads), b.sdiv(bh, heads)
        xrow = simd.gep(b, x, b.add(b.add(b.mul(bb, sx[0]), b.mul(hh, sx[1])),
                                    b.mul(t, sx[2])), x_elem)
        coff = b.add(b.add(b.mul(bb, sc[0]), b.mul(hh, sc[1])), b.mul(t, sc[2]))
        crow, srow = simd.gep(b, cos, coff, elem), simd.gep(b, sin, coff, elem)
        orow = simd.gep(b, out, b.add(b.add(b.mul(bb, so[0]), b.mul(hh, so[1])),
                                      b.mul(t, so[2])), elem)
        for i in range(0, half, lanes):
            active = min(lanes, half - i)
            lo, hi = const(i64, i), const(i64, half + i)

            def load(base, at, what=dtype):
                return bf16.load_as(b, what, base, at, lanes, active)
            x1, x2 = load(xrow, lo, x_dtype), load(xrow, hi, x_dtype)
            first = b.fadd(rounded(b.fmul(x1, load(crow, lo))),
                           rounded(b.fmul(b.fneg(x2), load(srow, lo))))
            second = b.fadd(rounded(b.fmul(x2, load(crow, hi))),
                            rounded(b.fmul(x1, load(srow, hi))))
            bf16.store_as(b, dtype, first, orow, lo, active)
            bf16.store_as(b, dtype, second, orow, hi, active)
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 4 + [i64] * 12, body.fn,
                      lambda b, args: omp.per_grain(b, b.mul(args[4], const(i64, d)), GRAIN))
    return module
