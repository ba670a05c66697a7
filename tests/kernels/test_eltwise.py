"""Vector exp/erf/tanh accuracy (in ulps vs float64) and GELU vs ATen."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.eltwise import make_eltwise, make_gelu


def ulps(y: torch.Tensor, ref64: torch.Tensor) -> torch.Tensor:
    spacing = torch.from_numpy(np.spacing(np.abs(ref64.float().numpy()))).double()
    return (y.double() - ref64).abs() / spacing


def dense(lo, hi, n=400_001):
    return torch.linspace(lo, hi, n)


@pytest.mark.parametrize("op,fn,lo,hi,max_ulp", [
    ("exp", torch.exp, -87.0, 88.5, 1.0),
    ("erf", torch.erf, -4.5, 4.5, 1.1),
    ("tanh", torch.tanh, -10.0, 10.0, 1.5)])
def test_vector_math_ulps(op, fn, lo, hi, max_ulp):
    """Bounds hold over every 7th float of the range too (checked offline: erf 1.03, tanh 1.32)."""
    torch.manual_seed(1)
    x = torch.cat([dense(lo, hi), dense(-1.0, 1.0), torch.randn(20_000)])
    y = make_eltwise(op, x.numel())(x)
    err = ulps(y, fn(x.double()))
    assert err.max().item() <= max_ulp, (op, x[err.argmax()].item(), err.max().item())


@pytest.mark.parametrize("op,fn", [("exp", torch.exp), ("erf", torch.erf),
                                   ("tanh", torch.tanh)])
def test_vector_math_special_values(op, fn):
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-30, -1e-30,
                      88.8, -104.5, 3.95, -3.95, 20.0, -20.0])
    y = make_eltwise(op, x.numel())(x)
    ref = fn(x.double()).float()
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    torch.testing.assert_close(y[ok], ref[ok], rtol=2e-7, atol=1e-37)


def test_exp_scales_into_the_denormal_range():
    """Below e**-87.3 the result is denormal: the scaling (vscalefps on AVX-512, two exponent
    multiplies elsewhere) rounds once, so it stays within one denormal step of float64's."""
    x = torch.cat([dense(-103.9, -87.4, 200_001), torch.tensor([-103.97, -87.34])])
    y = make_eltwise("exp", x.numel())(x).double()
    ref = torch.exp(x.double())
    step = 2.0 ** -149
    assert ((y - ref).abs() <= step * (1 + 1e-6) + ref * 2e-7).all()
    assert (y > 0).all()


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("numel", [1, 15, 17, 1000, 70_001])
def test_gelu_matches_aten(approximate, numel, threads):
    torch.manual_seed(numel)
    x = torch.randn(numel) * 4
    x[: min(numel, 4)] = torch.tensor([0.0, -0.0, -12.0, 12.0])[: min(numel, 4)]
    y = make_gelu(numel, approximate)(x)
    torch.testing.assert_close(y, F.gelu(x, approximate=approximate), rtol=1e-4, atol=1e-5)


def test_gelu_keeps_shape_and_nan():
    x = torch.randn(3, 5)
    x[1, 2] = float("nan")
    y = make_gelu(15)(x)
    assert y.shape == (3, 5) and torch.isnan(y[1, 2])
    ok = ~torch.isnan(x)
    torch.testing.assert_close(y[ok], F.gelu(x)[ok], rtol=1e-4, atol=1e-5)


def test_gelu_rejects_other_dtypes():
    with pytest.raises(NotImplementedError):
        make_gelu(8)(torch.randn(8, dtype=torch.float64))


def test_relu_matches_aten():
    x = torch.cat([torch.randn(70_003), torch.tensor([float("nan"), -0.0, 0.0, -float("inf")])])
    y = make_eltwise("relu", x.numel())(x)
    assert torch.equal(torch.isnan(y), torch.isnan(torch.relu(x)))
    ok = ~torch.isnan(x)
    assert torch.equal(y[ok], torch.relu(x)[ok])


# ---- bfloat16: load bf16, compute in float32, round once (ATen's round-to-nearest-even) ----
#
# Measured over all 65536 bf16 inputs (2-core Zen 4, torch 2.13): the bf16 kernels are the float32
# kernels rounded once, bit for bit. exp, erf and tanh are correctly rounded on every input (0 ulp
# from float64), and bit-identical to ATen's bf16 exp and tanh (ATen's bf16 erf is 0 for |x| below
# ~0.007: no reference). GELU outside x in [-10, -3] (where 1 + erf cancels) is correctly rounded
# (tanh form: one input 1 ulp off, as ATen's is). Against ATen's bf16 GELU, bit-identical except
# where ATen's float32 answer is off: erf form x in [-10, -3] (|diff| <= 2^-16, 12 inputs more than
# 1 ulp apart; Kwker's float32 is the closer to float64), tanh form x in [-5.2, -5] (4 inputs, ATen
# -0, |diff| <= 2^-22), results below FLT_MIN (ATen's vcvtneps2bf16 path flushes them to 0 on
# AVX512_BF16 CPUs; Kwker keeps them, as c10's rounding does), x >= 2^127 (ATen overflows to inf)
# and +inf (ATen's erf form gives NaN, Kwker the limit +inf). -inf gives NaN, as in ATen. NaN gives
# NaN, always 0x7FC0 (c10's canonical bf16 NaN; ATen's vector paths keep other payloads).

BF16 = torch.bfloat16
ALL_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(BF16)  # every bit pattern
FLT_MIN = 2.0 ** -126
GELU_TAIL = {"none": ((-10.0, -3.0), 2.0 ** -16), "tanh": ((-5.2, -5.0), 2.0 ** -22)}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16).int() & 0xFFFF


def bf16_ulps(a, b):
    """Distance in bf16 steps between finite bf16 tensors (-0 and +0 are 0 apart)."""
    def ordinal(t):
        v = bits(t)
        return torch.where(v >= 0x8000, 0x8000 - v, v)
    return (ordinal(a) - ordinal(b)).abs()


def assert_bits_equal(y, ref):
    """Bit-identical, except that NaN payloads only need both to be NaN; Kwker's NaN is 0x7FC0."""
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y), nan)
    assert (bits(y)[nan] == 0x7FC0).all()
    bad = (bits(y) != bits(ref)) & ~nan
    assert not bad.any(), list(zip(y[bad][:5].tolist(), ref[bad][:5].tolist()))


def assert_gelu_bf16_matches_aten(x, y, approximate):
    """``y = kwker gelu(x)`` against ATen's bf16 GELU by the rule measured above."""
    ref = F.gelu(x, approximate=approximate)
    xf, yf, rf = x.float(), y.float(), ref.float()
    (lo, hi), tail_bound = GELU_TAIL[approximate]
    known = (F.gelu(xf, approximate=approximate).abs() < FLT_MIN) | (xf >= 2.0 ** 127)
    if approximate == "none":
        known |= xf == float("inf")
    tail = (xf >= lo) & (xf <= hi)
    exact = ~known & ~tail
    assert_bits_equal(y[exact], ref[exact])
    assert ((yf - rf)[tail].abs() <= tail_bound).all(), (yf - rf)[tail].abs().max()
    small = known & ~tail & (xf.abs() < 1.0)
    assert ((yf - rf)[small].abs() <= FLT_MIN).all()  # ATen flushes them to 0 (or agrees)
    assert torch.equal(y[xf >= 2.0 ** 127], x[xf >= 2.0 ** 127])  # GELU(x) = x up there
    assert torch.equal(torch.isnan(y), torch.isnan(xf) | (xf == -float("inf")))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_bf16_every_input(approximate, threads):
    y = make_gelu(65536, approximate, BF16)(ALL_BF16)
    assert y.dtype == BF16
    # one rounding of Kwker's float32 GELU (ATen's .bfloat16() rounds to nearest even too)
    assert_bits_equal(y, make_gelu(65536, approximate)(ALL_BF16.float()).bfloat16())
    assert_gelu_bf16_matches_aten(ALL_BF16, y, approximate)
    # outside the cancellation tail: correctly rounded (erf form), within 1 ulp (tanh form: one
    # input, x = -2.984375, is 1 ulp off, as ATen's is)
    x64 = ALL_BF16.double()
    ok = ((x64 > -3.0) | (x64 < -10.0)) & ~torch.isnan(x64) & (x64.abs() != float("inf"))
    ulp = bf16_ulps(y[ok], F.gelu(x64, approximate=approximate).to(BF16)[ok])
    assert ulp.max() <= (0 if approximate == "none" else 1) and (ulp > 0).sum() <= 1


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_bf16_special_values(approximate):
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([0.0, -0.0, inf, -inf, nan, -nan, 1e-40, -1e-40, 3e38, -3e38, 1.0, -1.0,
                      -4.0, 8.0, -12.0], dtype=BF16)
    y = make_gelu(x.numel(), approximate, BF16)(x)
    assert bits(y)[:2].tolist() == [0x0000, 0x8000]  # +0 -> +0, -0 -> -0
    assert y[2].item() == inf and torch.isnan(y[3:6]).all() and (bits(y)[3:6] == 0x7FC0).all()
    assert y[8].item() == x[8].item() and bits(y)[9].item() == 0x8000  # x and -0 at +-3e38
    assert_gelu_bf16_matches_aten(x, y, approximate)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("numel", [1, 7, 15, 16, 17, 31, 33, 1000, 4097, 70_001])
def test_gelu_bf16_tails(approximate, numel, threads):
    """Every position (vector body, unrolled body, masked tail, each thread's share) gives the
    same answer as the exhaustive run; specials sit at both ends, where the masked tail is."""
    torch.manual_seed(numel)
    x = (torch.randn(numel) * 4).to(BF16)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), -5.0, 1e-39],
                            dtype=BF16)
    k = min(numel, specials.numel())
    x[:k], x[numel - k:] = specials[:k], specials[:k]
    y = make_gelu(numel, approximate, BF16)(x)
    table = make_gelu(65536, approximate, BF16)(ALL_BF16)
    assert_bits_equal(y, table[bits(x).long()])
    assert_gelu_bf16_matches_aten(x, y, approximate)


def test_gelu_bf16_keeps_shape_and_runs_in_place():
    from kwker.kernels._call import entry
    x = (torch.randn(3, 5, 7) * 3).to(BF16)
    g = make_gelu(105, "tanh", BF16)
    y = g(x)
    assert y.shape == x.shape and y.dtype == BF16
    assert_gelu_bf16_matches_aten(x, y, "tanh")
    assert torch.equal(bits(g(x.transpose(0, 2))), bits(F.gelu(x.transpose(0, 2).float(),
                       approximate="tanh").to(BF16)))  # non-contiguous: the checked slow path
    inplace = x.clone()
    entry(g.spec, 2)(inplace.data_ptr(), inplace.data_ptr(), 2)
    assert torch.equal(bits(inplace), bits(y))


def test_bf16_kernel_rejects_other_dtypes():
    with pytest.raises(NotImplementedError):
        make_gelu(8, dtype=BF16)(torch.randn(8))
    with pytest.raises(NotImplementedError):
        make_gelu(8, dtype=torch.float16)
    with pytest.raises(ValueError):
        make_gelu(8, dtype=BF16)(torch.randn(9).to(BF16))


@pytest.mark.parametrize("op,fn", [("relu", torch.relu), ("exp", torch.exp), ("erf", torch.erf),
                                   ("tanh", torch.tanh)])
def test_bf16_ops_every_input(op, fn, threads):
    """relu, exp, tanh: bit-identical to ATen's bf16 ops on every input; exp, erf, tanh correctly
    rounded (ATen's bf16 erf is 0 below |x| ~ 0.007 and not a reference there)."""
    y = make_eltwise(op, 65536, BF16)(ALL_BF16)
    assert_bits_equal(y, make_eltwise(op, 65536)(ALL_BF16.float()).to(BF16))
    if op != "erf":
        assert_bits_equal(y, fn(ALL_BF16))
    if op != "relu":
        assert_bits_equal(y, fn(ALL_BF16.double()).to(BF16))
    z = make_eltwise(op, 70_001, BF16)(ALL_BF16.repeat(2)[5:70_006])  # odd size, unaligned start
    assert_bits_equal(z, y.repeat(2)[5:70_006])


_ISA_WORKER = """
import sys, torch
from kwker.kernels.eltwise import make_eltwise, make_gelu
from kwker.runtime.target import host_target
torch.set_num_threads(2)
x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
x = torch.cat([x, x[:4465]])  # 70001: an odd tail
out = {op: make_eltwise(op, x.numel(), torch.bfloat16)(x)
       for op in ("gelu", "gelu_tanh", "relu", "exp", "erf", "tanh")}
torch.save(out, sys.argv[1])
print("target", host_target().describe())
"""


@pytest.mark.parametrize("cpu,isa", [("haswell", "AVX2"), ("x86-64-v2", "SSE")])
def test_bf16_eltwise_on_other_isa(cpu, isa, tmp_path):
    """The AVX2 and SSE kernels (KWKER_CPU alone names the target) give the same bits as this
    host's: 8- and 4-lane i16 loads, masked tails and the integer rounding are ISA-free."""
    import os
    import subprocess
    import sys

    from kwker.runtime.target import host_target
    if isa == "AVX2" and not host_target().has("avx2"):
        pytest.skip("host cannot run AVX2 code")
    env = dict(os.environ, KWKER_CPU=cpu, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("KWKER_FEATURES", None)
    r = subprocess.run([sys.executable, "-c", _ISA_WORKER, str(tmp_path / "out.pt")], env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"target {cpu} ({isa}" in r.stdout, r.stdout
    got = torch.load(tmp_path / "out.pt")
    x = torch.cat([ALL_BF16, ALL_BF16[:4465]])
    for op, y in got.items():
        assert_bits_equal(y, make_eltwise(op, x.numel(), BF16)(x))
    assert_gelu_bf16_matches_aten(x, got["gelu"], "none")
    assert_gelu_bf16_matches_aten(x, got["gelu_tanh"], "tanh")


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 1000, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_mul_matches_eager(numel, dtype):
    """SwiGLU's ``silu(g) * u``: float32 within an ulp or two of ATen's two ops, bf16 equal
    (both round the SiLU to bf16 before the product); NaN and inf as ATen gives them."""
    from kwker.kernels.eltwise import make_silu_mul
    gen = torch.Generator().manual_seed(numel)
    g = (torch.randn(numel, generator=gen) * 6).to(dtype)
    u = torch.randn(numel, generator=gen).to(dtype)
    if numel > 3:
        g[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    ref = torch.nn.functional.silu(g) * u
    for fn in (make_silu_mul(numel, dtype), make_silu_mul(None, dtype)):
        y = fn(g, u)
        assert torch.equal(y.isnan(), ref.isnan())
        if dtype == torch.bfloat16:
            assert (y[~ref.isnan()] != ref[~ref.isnan()]).float().mean() <= 0.001
        torch.testing.assert_close(y, ref, rtol=1e-6 if dtype == torch.float32 else 2 ** -7,
                                   atol=1e-6 if dtype == torch.float32 else 1e-3,
                                   equal_nan=True)
    with pytest.raises(ValueError, match="is not x's shape"):
        make_silu_mul(None)(torch.zeros(4), torch.zeros(5))


@pytest.mark.parametrize("shape", [(1, 2), (3, 34), (2, 5, 2 * 70), (4, 1, 2 * 9), (9, 2 * 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_mul_rows_reads_chunk_halves(shape, dtype):
    """The row kernel on the two halves of ``t.chunk(2, -1)`` (rows a stride apart) and on
    contiguous copies, against ATen's two ops (NaN and inf included); a contiguous output;
    inputs that are not rows of one stride (a transpose) or of other shapes are ATen's."""
    from kwker.kernels.eltwise import make_silu_mul_rows
    gen = torch.Generator().manual_seed(shape[-1])
    t = (torch.randn(shape, generator=gen) * 6).to(dtype)
    special = torch.tensor([float("nan"), float("inf"), -float("inf")])[:t.numel()]
    t.view(-1)[:len(special)] = special
    g, u = t.chunk(2, dim=-1)
    fn = make_silu_mul_rows(dtype)
    y, ref = fn(g, u), torch.nn.functional.silu(g) * u
    assert y.is_contiguous() and y.shape == ref.shape
    torch.testing.assert_close(y, ref, rtol=1e-6 if dtype == torch.float32 else 2 ** -7,
                               atol=1e-6 if dtype == torch.float32 else 1e-3, equal_nan=True)
    # contiguous inputs (separate gate and up projections) take the same kernel
    g, u = g.contiguous(), u.contiguous()
    y = fn(g, u)
    assert y.is_contiguous()
    torch.testing.assert_close(y, ref, rtol=1e-6 if dtype == torch.float32 else 2 ** -7,
                               atol=1e-6 if dtype == torch.float32 else 1e-3, equal_nan=True)
    c = torch.randn(7, 5).to(dtype).t()
    torch.testing.assert_close(fn(c, c), torch.nn.functional.silu(c) * c)
    # layouts are remembered by shape and strides: the halves again, halves of that shape a
    # wider stride apart, and the transpose again (ATen's) all answer as ATen does
    h = shape[-1] // 2
    wide = torch.randn(*shape[:-1], 3 * h, generator=gen).to(dtype)
    for a, b in (t.chunk(2, dim=-1), (wide[..., :h], wide[..., h:2 * h]), (c, c)):
        torch.testing.assert_close(fn(a, b), torch.nn.functional.silu(a) * b, equal_nan=True,
                                   rtol=1e-6 if dtype == torch.float32 else 2 ** -7,
                                   atol=1e-6 if dtype == torch.float32 else 1e-3)
    with pytest.raises(RuntimeError):   # shapes that do not broadcast: ATen's error
        fn(torch.zeros(4, dtype=dtype), torch.zeros(5, dtype=dtype))
