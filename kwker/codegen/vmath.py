"""Vector float32 exp, erf, tanh and GELU, as inline IR (no libm call per element).

Each function is emitted once per module as an ``internal alwaysinline`` helper for the vector type
it is used with, so kernels call ``vmath.exp(b, x)`` and LLVM inlines straight-line FMA code.

Accuracy (float32, checked over dense samples in tests/codegen/test_vmath.py against float64):
exp <= 1 ulp, erf <= 1 ulp, tanh <= 2 ulp. Coefficients are least-squares fits on Chebyshev nodes
(numpy, float64), rounded to float32 and re-checked with FMA Horner evaluation.

- exp: Cody-Waite reduction x = n ln2 + r, exp(r) = 1 + r + r^2 P(r) with deg-5 P, then the
  scale 2^n applied as two exact powers of two so results down to the denormal range (x >= -104)
  stay right; x > 88.72 gives +inf, NaN passes through.
- erf: odd, computed on |x|: x + x P(x^2) below 0.875; 1 - Q(|x| - c) on [0.875, 2.5) and
  [2.5, 3.9375) (shifted polynomials keep the fit well conditioned); 1 beyond.
- tanh: x + x^3 P(x^2) below 0.625, else 1 - 2 / (exp(2|x|) + 1), sign restored.
Fast-math policy: none (explicit ``llvm.fma`` only), so results do not depend on LLVM flags.
"""
from __future__ import annotations

import math

from llvmlite import ir

from .irutil import f32, i32, intrinsic

EXP_P = (0.00019899278413504362, 0.0013933662557974458, 0.0083332983776927,
         0.041666463017463684, 0.1666666716337204, 0.5)
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4
ERF_SMALL = (8.71357333380729e-05, -0.0008216510759666562, 0.005206874571740627,
             -0.02686147950589657, 0.1128372848033905, -0.37612634897232056,
             0.12837916612625122)
ERF_MID_C, ERF_MID = 1.6875, (
    0.00027810607571154833, -0.0010333724785596132, -4.900978456134908e-05,
    0.006193861365318298, -0.011707659810781479, -0.00273119262419641, 0.049599867314100266,
    -0.10239776968955994, 0.11040183901786804, -0.0654233768582344, 0.017010286450386047)
ERF_TAIL_C, ERF_TAIL = 3.21875, (
    -1.9990632154076593e-06, -2.070570735668298e-05, 9.087335638469085e-05,
    -0.00019440303731244057, 0.00030252058058977127, -0.0003661303489934653,
    0.0003397070395294577, -0.00023492779291700572, 0.00011499762331368402,
    -3.5726523492485285e-05, 5.31385467184009e-06)
TANH_P = (0.0023139938712120056, -0.008365684188902378, 0.021776851266622543,
          -0.05396048352122307, 0.13333310186862946, -0.3333333432674408)


def splat(ty: ir.Type, value) -> ir.Constant:
    """A constant of ``ty`` (scalar or vector) with every lane equal to ``value``."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
    return ir.Constant(ty, value)


def _suffix(ty: ir.Type) -> str:
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else "f32"


def _int_type(ty: ir.Type) -> ir.Type:
    return ir.VectorType(i32, ty.count) if isinstance(ty, ir.VectorType) else i32


def fma(b: ir.IRBuilder, x, y, z):
    fn = intrinsic(b.module, f"llvm.fma.{_suffix(x.type)}", x.type, [x.type] * 3)
    return b.call(fn, [x, y, z])


def unary(b: ir.IRBuilder, name: str, x):
    fn = intrinsic(b.module, f"llvm.{name}.{_suffix(x.type)}", x.type, [x.type])
    return b.call(fn, [x])


def horner(b: ir.IRBuilder, coeffs, x):
    r = splat(x.type, coeffs[0])
    for c in coeffs[1:]:
        r = fma(b, r, x, splat(x.type, c))
    return r


def _helper(b: ir.IRBuilder, name: str, ty: ir.Type, body) -> ir.Value:
    """Get or emit ``name`` for ``ty`` as an always-inlined function built by ``body(b, x)``."""
    full = f"kw.{name}.{_suffix(ty)}"
    module = b.module
    try:
        return module.get_global(full)
    except KeyError:
        pass
    fn = ir.Function(module, ir.FunctionType(ty, [ty]), name=full)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    fb = ir.IRBuilder(fn.append_basic_block("entry"))
    fb.ret(body(fb, fn.args[0]))
    return fn


def _call(b: ir.IRBuilder, name: str, body, x):
    return b.call(_helper(b, name, x.type, body), [x])


def _clamp(b, x, lo, hi):
    ty = x.type
    x = b.select(b.fcmp_ordered(">", x, splat(ty, hi)), splat(ty, hi), x)
    return b.select(b.fcmp_ordered("<", x, splat(ty, lo)), splat(ty, lo), x)


def _pow2(b, n):
    """2**n as float for integer vectors n in [-126, 127]."""
    it = n.type
    return b.bitcast(b.shl(b.add(n, splat(it, 127)), splat(it, 23)), _float_like(it))


def _float_like(it: ir.Type) -> ir.Type:
    return ir.VectorType(f32, it.count) if isinstance(it, ir.VectorType) else f32


def _exp_body(b: ir.IRBuilder, x):
    ty = x.type
    nan = b.fcmp_unordered("uno", x, x)
    xc = b.select(nan, splat(ty, 0.0), _clamp(b, x, -104.0, 88.75))
    n = unary(b, "rint", b.fmul(xc, splat(ty, 1.4426950408889634)))
    r = fma(b, n, splat(ty, -LN2_HI), xc)
    r = fma(b, n, splat(ty, -LN2_LO), r)
    p = horner(b, EXP_P, r)
    y = b.fadd(splat(ty, 1.0), fma(b, p, b.fmul(r, r), r))
    ni = b.fptosi(n, _int_type(ty))
    half = b.ashr(ni, splat(ni.type, 1))
    y = b.fmul(b.fmul(y, _pow2(b, half)), _pow2(b, b.sub(ni, half)))
    y = b.select(b.fcmp_ordered(">", x, splat(ty, 88.72283935546875)), splat(ty, math.inf), y)
    y = b.select(b.fcmp_ordered("<", x, splat(ty, -104.0)), splat(ty, 0.0), y)
    return b.select(nan, x, y)


def exp(b: ir.IRBuilder, x):
    """e**x for a float32 scalar or vector."""
    return _call(b, "exp", _exp_body, x)


def _copysign(b, mag, sign_of):
    return unary_two(b, "copysign", mag, sign_of)


def unary_two(b, name, x, y):
    fn = intrinsic(b.module, f"llvm.{name}.{_suffix(x.type)}", x.type, [x.type, x.type])
    return b.call(fn, [x, y])


def _erf_body(b: ir.IRBuilder, x):
    """One Horner chain for all three ranges: coefficients are picked per lane (blends are
    cheaper than FMAs here), y = s * P(v) + t with (v, s, t) = (a^2, a, a) below 0.875 and
    (a - c, -1, 1) above."""
    ty = x.type
    a = unary(b, "fabs", x)
    in_small = b.fcmp_ordered("<", a, splat(ty, 0.875))
    in_mid = b.fcmp_ordered("<", a, splat(ty, 2.5))
    centre = b.select(in_mid, splat(ty, ERF_MID_C), splat(ty, ERF_TAIL_C))
    v = b.select(in_small, b.fmul(a, a), b.fsub(a, centre))
    small = (0.0,) * (len(ERF_MID) - len(ERF_SMALL)) + ERF_SMALL
    r = None
    for cs, cm, ct in zip(small, ERF_MID, ERF_TAIL):
        c = b.select(in_small, splat(ty, cs), b.select(in_mid, splat(ty, cm), splat(ty, ct)))
        r = c if r is None else fma(b, r, v, c)
    s = b.select(in_small, a, splat(ty, -1.0))
    t = b.select(in_small, a, splat(ty, 1.0))
    y = fma(b, s, r, t)
    y = b.select(b.fcmp_ordered("<", a, splat(ty, 3.9375)), y, splat(ty, 1.0))
    y = b.select(b.fcmp_unordered("uno", x, x), x, y)
    return _copysign(b, y, x)


def erf(b: ir.IRBuilder, x):
    """The error function for a float32 scalar or vector."""
    return _call(b, "erf", _erf_body, x)


def _tanh_body(b: ir.IRBuilder, x):
    ty = x.type
    a = unary(b, "fabs", x)
    a2 = b.fmul(a, a)
    small = fma(b, b.fmul(a, a2), horner(b, TANH_P, a2), a)
    e = exp(b, b.fadd(a, a))
    large = b.fsub(splat(ty, 1.0), b.fdiv(splat(ty, 2.0), b.fadd(e, splat(ty, 1.0))))
    y = b.select(b.fcmp_ordered("<", a, splat(ty, 0.625)), small, large)
    return _copysign(b, y, x)


def tanh(b: ir.IRBuilder, x):
    """Hyperbolic tangent for a float32 scalar or vector."""
    return _call(b, "tanh", _tanh_body, x)


def _gelu_erf_body(b: ir.IRBuilder, x):
    ty = x.type
    e = erf(b, b.fmul(x, splat(ty, 0.7071067811865476)))
    return b.fmul(b.fmul(x, splat(ty, 0.5)), b.fadd(e, splat(ty, 1.0)))


def _gelu_tanh_body(b: ir.IRBuilder, x):
    ty = x.type
    x3 = b.fmul(b.fmul(x, x), x)
    inner = b.fmul(fma(b, x3, splat(ty, 0.044715), x), splat(ty, 0.7978845608028654))
    return b.fmul(b.fmul(x, splat(ty, 0.5)), b.fadd(tanh(b, inner), splat(ty, 1.0)))


def gelu(b: ir.IRBuilder, x, approximate: str = "none"):
    """GELU as torch defines it: erf form for ``approximate="none"``, tanh form for "tanh"."""
    if approximate == "none":
        return _call(b, "gelu", _gelu_erf_body, x)
    if approximate == "tanh":
        return _call(b, "gelu_tanh", _gelu_tanh_body, x)
    raise ValueError(f"GELU approximate must be 'none' or 'tanh', not {approximate!r}")


def relu(b: ir.IRBuilder, x):
    """max(x, 0) with NaN propagated, as torch.relu does."""
    return b.select(b.fcmp_ordered("<", x, splat(x.type, 0.0)), splat(x.type, 0.0), x)


def activation(b: ir.IRBuilder, name: str, x):
    """Epilogue activation by name: none, relu, gelu, gelu_tanh."""
    if name == "none":
        return x
    if name == "relu":
        return relu(b, x)
    if name == "gelu":
        return gelu(b, x, "none")
    if name == "gelu_tanh":
        return gelu(b, x, "tanh")
    raise ValueError(f"unknown activation {name!r}")
