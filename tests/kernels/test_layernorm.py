"""make_layer_norm against ATen's F.layer_norm, float32 and bfloat16, generic and fixed rows.

float32 agrees with ATen to float32 rounding, and on rows far from 0 (x + 1000, where E[x^2] -
E[x]^2 fails) stays within 2e-6 of float64 while ATen's error grows with the offset. bfloat16
is ATen's formula on a mean and rstd computed differently (two passes, not Welford), so a
float32 ulp of difference there flips a rounding now and then: measured on a 2-core Zen 4
(torch 2.13), 1e-5 to 2e-4 of the elements differ, by one bf16 ulp of the result except where
the result is the small remainder of a cancellation; with an offset of 1000 (bf16 inputs 4-8
apart) ATen's x * rstd - rstd * mean cancels and 2-7% differ, ours as close to float64.
"""
import struct

import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.norm import make_layer_norm
from kwker.kernels.specs import LayerNormSpec
from kwker.runtime.compiler import compile_assembly
from kwker.runtime.kernel import ir_text
from kwker.runtime.target import make_target
from kwker.spec import spec_from_json

BF16 = torch.bfloat16
DS = (1, 7, 16, 33, 384, 768, 1000)
ROWS = (1, 3, 64, 1000)
AFFINE = ("wb", "w", "b", "none")


def params(d, affine, gen, dtype=torch.float32):
    w = torch.randn(d, generator=gen).to(dtype) if "w" in affine else None
    b = torch.randn(d, generator=gen).to(dtype) if "b" in affine else None
    return w, b


def ref64(x, d, w, b, eps):
    return F.layer_norm(x.double(), (d,), None if w is None else w.double(),
                        None if b is None else b.double(), eps)


@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize("affine", AFFINE)
def test_f32_generic(d, affine):
    """One generic kernel for every row count; rows far from 0 stay close to float64."""
    gen = torch.Generator().manual_seed(d)
    w, b = params(d, affine, gen)
    f = make_layer_norm(d, w, b, 1e-5)
    for rows in ROWS:
        for scale, offset in ((1.0, 0.0), (3.0, 5.0), (1e-3, 0.0), (100.0, 0.0)):
            x = torch.randn(rows, d, generator=gen) * scale + offset
            torch.testing.assert_close(f(x), F.layer_norm(x, (d,), w, b, 1e-5),
                                       rtol=1e-5, atol=1e-5)
        x = torch.randn(rows, d, generator=gen) + 1000
        err = (f(x).double() - ref64(x, d, w, b, 1e-5)).abs().max().item()
        assert err < 1e-5, (rows, err)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("d", DS)
def test_fixed_rows(d, dtype):
    gen = torch.Generator().manual_seed(d + 1)
    w, b = params(d, "wb", gen)
    for rows in ROWS:
        f = make_layer_norm(d, w, b, 1e-5, rows=rows, dtype=dtype)
        x = torch.randn(rows, d, generator=gen).to(dtype)
        y, ref = f(x), F.layer_norm(x, (d,), w, b, 1e-5)
        assert y.dtype == dtype and y.shape == x.shape
        if dtype == BF16:
            assert_bf16_close(x, y, ref, w, b, 1e-5)
        else:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def bf16_spacing(t: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at |t| (8 significant bits)."""
    e = torch.frexp(t.abs().clamp_min(2.0 ** -126))[1]
    return torch.ldexp(torch.ones_like(t), e - 8)


def assert_bf16_close(x, y, ref, w, b, eps, max_differ=5e-4):
    """``y`` equals ATen's bf16 ``ref`` but on a few elements, by one ulp of the result or, where
    the result is what is left of a cancellation, by float32 rounding of the terms that cancel
    ((|x| + |mean|) * rstd * |w| and |b|, float32 ulp 2^-24: bounded by 2^-18 of them)."""
    y, ref, xd = y.double(), ref.double(), x.double()
    mean = xd.mean(-1, keepdim=True)
    rstd = (xd.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    terms = (xd.abs() + mean.abs()) * rstd * (1 if w is None else w.double().abs()) \
        + (0 if b is None else b.double().abs())
    diff = (y - ref).abs()
    allowed = bf16_spacing(torch.maximum(y.abs(), ref.abs())) + 2.0 ** -18 * terms
    assert (diff <= allowed).all(), (diff - allowed).max().item()
    assert (diff > 0).double().mean().item() <= max_differ


@pytest.mark.parametrize("wdtype", [torch.float32, BF16, None])
@pytest.mark.parametrize("d", DS)
def test_bf16_generic_matches_aten(d, wdtype):
    """bf16 x and out, weight/bias in float32 (ATen's mixed-type path) or bf16 or none."""
    gen = torch.Generator().manual_seed(d + 2)
    w, b = params(d, "wb" if wdtype else "none", gen, wdtype or torch.float32)
    f = make_layer_norm(d, w, b, 1e-5, dtype=BF16)
    x = torch.cat([torch.randn(1000, d, generator=gen) * 3,
                   torch.randn(1000, d, generator=gen) + 5]).to(BF16)
    for rows in (*ROWS, 2000):
        y, ref = f(x[:rows]), F.layer_norm(x[:rows], (d,), w, b, 1e-5)
        assert y.dtype == BF16
        assert_bf16_close(x[:rows], y, ref, w, b, 1e-5, max_differ=5e-4 if rows > 64 else 0.02)


def test_bf16_far_from_zero_as_close_as_aten():
    """x + 1000 in bf16: ATen's x * rstd - rstd * mean cancels, so roundings differ more often
    (a few %); Kwker's error against float64 is ATen's."""
    gen = torch.Generator().manual_seed(5)
    d = 384
    w, b = params(d, "wb", gen)
    x = (torch.randn(1000, d, generator=gen) * 3 + 1000).to(BF16)
    y, ref = make_layer_norm(d, w, b, 1e-5, dtype=BF16)(x), F.layer_norm(x, (d,), w, b, 1e-5)
    exact = ref64(x, d, w, b, 1e-5)
    ours, aten = (y.double() - exact).abs(), (ref.double() - exact).abs()
    assert ours.mean() <= aten.mean() * 1.01
    assert ours.max() <= aten.max() + 2 * bf16_spacing(exact.abs()).max()
    assert (y != ref).double().mean() < 0.1


@pytest.mark.parametrize("eps", [0.0, 1e-12, 1e-5, 0.1, 3.0])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_eps(eps, dtype):
    gen = torch.Generator().manual_seed(7)
    d = 33
    w, b = params(d, "wb", gen)
    x = (torch.randn(50, d, generator=gen) * torch.rand(50, 1, generator=gen)).to(dtype)
    y, ref = make_layer_norm(d, w, b, eps, dtype=dtype)(x), F.layer_norm(x, (d,), w, b, eps)
    if dtype == BF16:
        assert_bf16_close(x, y, ref, w, b, eps, max_differ=0.01)
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("d", [1, 20, 384])
def test_inf_and_nan_propagate_as_in_aten(d, dtype):
    """A row holding inf, -inf or NaN comes out all NaN; the other rows are untouched."""
    gen = torch.Generator().manual_seed(d)
    w, b = params(d, "wb", gen)
    x = torch.randn(8, d, generator=gen)
    x[1, d // 2], x[3, -1], x[5, 0] = float("inf"), float("-inf"), float("nan")
    x[6, :] = float("inf")
    x = x.to(dtype)
    y, ref = make_layer_norm(d, w, b, 1e-5, dtype=dtype)(x), F.layer_norm(x, (d,), w, b, 1e-5)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.isnan(y[[1, 3, 5, 6]]).all()
    ok = [0, 2, 4, 7]
    if dtype == BF16:
        assert_bf16_close(x[ok], y[ok], ref[ok], w, b, 1e-5, max_differ=0.02)
    else:
        torch.testing.assert_close(y[ok], ref[ok], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_threads_give_identical_results(dtype):
    gen = torch.Generator().manual_seed(3)
    d = 768
    w, b = params(d, "wb", gen)
    f, g = make_layer_norm(d, w, b, 1e-5, dtype=dtype), \
        make_layer_norm(d, w, b, 1e-5, rows=300, dtype=dtype)
    x = torch.randn(300, d, generator=gen).to(dtype)  # large enough to fork
    out = {}
    for n in (1, 2):
        torch.set_num_threads(n)
        out[n] = (f(x), g(x))
    for a, c in zip(out[1], out[2]):
        assert torch.equal(a.view(torch.int16) if dtype == BF16 else a.view(torch.int32),
                           c.view(torch.int16) if dtype == BF16 else c.view(torch.int32))
    assert torch.equal(out[1][0], out[1][1])


def test_shapes_views_and_empty():
    gen = torch.Generator().manual_seed(4)
    d = 16
    w, b = params(d, "wb", gen)
    f = make_layer_norm(d, w, b, 1e-5)
    x = torch.randn(2, 5, 7, d, generator=gen)
    torch.testing.assert_close(f(x), F.layer_norm(x, (d,), w, b, 1e-5), rtol=1e-5, atol=1e-5)
    view = torch.randn(d, 9, generator=gen).t()  # not contiguous: copied, as in the factories
    torch.testing.assert_close(f(view), F.layer_norm(view, (d,), w, b, 1e-5),
                               rtol=1e-5, atol=1e-5)
    for shape in [(0, d), (3, 0, d)]:
        y = f(torch.empty(shape))
        assert y.shape == shape and y.dtype == torch.float32


def test_weight_and_bias_are_copied_once():
    d = 40
    w, b = torch.randn(d).to(BF16), torch.randn(d).to(BF16)
    f = make_layer_norm(d, w, b, 1e-5, dtype=BF16)
    assert f.weight.dtype == f.bias.dtype == torch.float32 and torch.equal(f.weight, w.float())
    x = torch.randn(4, d).to(BF16)
    before = f(x)
    w.zero_()
    b.fill_(3)
    assert torch.equal(f(x), before)


def test_bad_inputs():
    d = 8
    f, g = make_layer_norm(d, None, None, 1e-5), make_layer_norm(d, None, None, 1e-5, rows=4)
    with pytest.raises(NotImplementedError):
        f(torch.randn(4, d, dtype=torch.float64))
    with pytest.raises(NotImplementedError):
        f(torch.randn(4, d).to(BF16))
    for bad in (torch.randn(4, d + 1), torch.tensor(1.0)):
        with pytest.raises(ValueError):
            f(bad)
    with pytest.raises(ValueError):
        g(torch.randn(5, d))
    with pytest.raises(NotImplementedError):
        make_layer_norm(d, None, None, 1e-5, dtype=torch.float16)
    with pytest.raises(NotImplementedError):  # a float32 kernel with bf16 weights
        make_layer_norm(d, torch.ones(d).to(BF16), None, 1e-5)
    with pytest.raises(ValueError):
        make_layer_norm(d, torch.ones(d + 1), None, 1e-5)
    with pytest.raises(ValueError):
        make_layer_norm(0, None, None, 1e-5)
    with pytest.raises(ValueError):
        make_layer_norm(d, None, None, 1e-5, rows=0)


def test_spec_symbol_and_json():
    eps = 1e-5
    near = struct.unpack("<d", struct.pack("<Q", struct.unpack("<Q", struct.pack("<d", eps))[0]
                                           + 1))[0]
    a, c = LayerNormSpec(384, 0, eps, True, True), LayerNormSpec(384, 0, near, True, True)
    assert a.symbol != c.symbol and a.symbol.isidentifier()
    assert LayerNormSpec(384, 0, eps, True, True, "bf16").symbol != a.symbol
    assert spec_from_json(a.to_json()) == a


@pytest.mark.parametrize("cpu,features,reg,lanes", [
    ("skylake-avx512", "+avx,+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512dq", "zmm", 16),
    ("haswell", "+avx,+avx2,+fma,-avx512f,-avx512bw,-avx512vl,-avx512dq", "ymm", 8)])
def test_ir_exact_sqrt_no_fast_math_masked_tail(cpu, features, reg, lanes):
    """Vectors of the target's width, a masked tail instead of a scalar loop, llvm.sqrt (not an
    approximate rsqrt) and no fast-math flags."""
    target = make_target(cpu, features)
    for dtype in ("f32", "bf16"):
        text = ir_text(LayerNormSpec(33, 0, 1e-5, True, True, dtype), target)
        assert "llvm.sqrt.f32" in text and f"llvm.fma.v{lanes}f32" in text
        assert f"llvm.masked.load.v{lanes}" in text
        assert not any(flag in text.split() for flag in ("fast", "reassoc", "afn", "arcp"))
        _, asm = compile_assembly(text, target)
        assert "rsqrt" not in asm and f"%{reg}" in asm


def test_profiler_shows_kernel_name():
    f = make_layer_norm(8, None, None, 1e-5)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        f(torch.randn(2, 8))
    assert f.spec.symbol in {e.name for e in prof.events()}


def rms_hf(x, w, eps):
    """transformers' LlamaRMSNorm, op by op."""
    h = x.float()
    y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if w is None else w * y


@pytest.mark.parametrize("d", (1, 7, 33, 384, 1000))
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [None, 5])
def test_rms_norm_matches_aten_and_transformers(d, dtype, rows):
    """RMSNorm in both roundings: ATen's ``F.rms_norm`` (one) and transformers' (before the
    weight). float32 within an ulp or two of each; bf16 equal but for rare one-ulp roundings
    (rstd computed as 1 / sqrt, not ATen's rsqrt)."""
    gen = torch.Generator().manual_seed(d)
    x = (torch.randn(5, d, generator=gen) * 3 + 0.5).to(dtype)
    w = torch.randn(d, generator=gen).to(dtype)
    for norm, weight, ref in (("rms", w, F.rms_norm(x, (d,), w, 1e-6)),
                              ("rms_hf", w, rms_hf(x, w, 1e-6)),
                              ("rms", None, F.rms_norm(x, (d,), None, 1e-6))):
        y = make_layer_norm(d, weight, None, 1e-6, rows, dtype, norm)(x)
        if dtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
        else:
            assert (y != ref).float().mean() <= 0.01
            torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=1e-3)


def test_rms_norm_special_values_and_bad_arguments():
    x = torch.randn(4, 16)
    x[1, 3], x[2, 0], x[3, 5] = float("nan"), float("inf"), 0.0
    x[3] = 0.0   # an all-zero row: 0 * rsqrt(eps)
    y = make_layer_norm(16, None, None, 1e-5, None, torch.float32, "rms")(x)
    ref = F.rms_norm(x, (16,), None, 1e-5)
    assert torch.equal(y.isnan(), ref.isnan())
    torch.testing.assert_close(y[~ref.isnan()], ref[~ref.isnan()])
    with pytest.raises(ValueError, match="no bias"):
        make_layer_norm(16, None, torch.zeros(16), 1e-5, norm="rms")
    with pytest.raises(ValueError, match="norm must be"):
        make_layer_norm(16, None, None, 1e-5, norm="batch")


@pytest.mark.parametrize("norm", ["layer", "rms", "rms_hf"])
@pytest.mark.parametrize("rows", [7, None], ids=["fixed", "generic"])
def test_bf16_output_of_float32_rows_is_the_cast_result(norm, rows):
    """``out_dtype=bf16`` (autocast's cast after a float32 norm, done by the kernel): exactly
    the float32 norm's result rounded to bf16, NaN and inf where they were."""
    torch.manual_seed(9)
    d = 384
    w, b = torch.randn(d), (torch.randn(d) if norm == "layer" else None)
    x = torch.randn(7, d) * 3 + 1
    x[0, 0], x[1, 5] = float("nan"), float("inf")
    got = make_layer_norm(d, w, b, 1e-5, rows, norm=norm, out_dtype=BF16)(x)
    want = make_layer_norm(d, w, b, 1e-5, rows, norm=norm)(x).to(BF16)
    assert got.dtype == BF16 and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(NotImplementedError):
        make_layer_norm(d, w, b, 1e-5, rows, dtype=BF16, norm=norm, out_dtype=torch.float32)
