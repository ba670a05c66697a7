"""Kernels generic over the size (``numel=None``, ``m=None``): one compile serves every size, and
every size gives what ATen gives (F.gelu; torch.topk of the unfused scores, ties and NaN
included), through the vector tails, the row-tile edges and both thread splits."""
import pytest
import torch
import torch.nn.functional as F

import kwker.kernels._call as call
from kwker.kernels import topk
from kwker.kernels.eltwise import make_eltwise, make_gelu
from kwker.kernels.linear import make_linear
from kwker.kernels.topk import make_linear_topk
from kwker.runtime import kernel
from kwker.runtime.target import host_target

from .test_eltwise import ALL_BF16, assert_bits_equal, assert_gelu_bf16_matches_aten, bits

BF16 = torch.bfloat16
PRIMES = [73, 97, 101, 127, 257, 1031]
ROWS = list(range(1, 71)) + PRIMES  # every row-tile edge, several tiles, past any bucket
NUMELS = list(range(1, 71)) + PRIMES + [4099, 8195, 70_001]  # tails, 1 and 2 thread shares
HAS_BF16 = host_target().has("avx512bf16")


@pytest.fixture
def no_new_kernels(monkeypatch):
    """Fails the test if a kernel is looked up, loaded or compiled while it runs."""
    events = []

    def forbid(name):
        def hook(*args, **kwargs):
            events.append(name)
            raise AssertionError(f"kwker {name} called inside a generic kernel's calls")
        return hook
    monkeypatch.setattr(call, "get_kernel", forbid("get_kernel"))
    monkeypatch.setattr(kernel, "object_for", forbid("object_for"))
    monkeypatch.setattr(kernel, "build_object", forbid("build_object"))
    yield events
    assert not events


def built(factory, *args, **kwargs):
    """``factory(*args)`` and the specs it fetched: a generic factory needs exactly one."""
    seen, real = [], call.get_kernel

    def spy(spec):
        seen.append(spec)
        return real(spec)
    call.get_kernel = spy
    try:
        fn = factory(*args, **kwargs)
    finally:
        call.get_kernel = real
    return fn, seen


# ---- elementwise ----------------------------------------------------------------------------

@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_generic_f32_every_size(approximate, threads, request):
    g, specs = built(make_gelu, None, approximate)
    assert [s.numel for s in specs] == [0] and g.spec.numel == 0
    torch.manual_seed(5)
    x = torch.randn(max(NUMELS)) * 4
    specials = torch.tensor([0.0, -0.0, -12.0, 12.0, float("inf"), -float("inf"), float("nan")])
    at = torch.arange(0, x.numel(), 53)
    x[at] = specials[torch.arange(at.numel()) % specials.numel()]
    whole = g(x)
    request.getfixturevalue("no_new_kernels")
    for n in NUMELS:
        y, ref = g(x[:n]), F.gelu(x[:n], approximate=approximate)
        # an element's result does not depend on where it falls (body, tail, thread share)
        assert torch.equal(y.view(torch.int32), whole[:n].view(torch.int32))
        # ATen's erf form gives NaN at +inf, Kwker the limit +inf (as test_eltwise documents)
        ref = torch.where(x[:n] == float("inf"), x[:n], ref)
        assert torch.equal(torch.isnan(y), torch.isnan(ref))
        ok = ~torch.isnan(ref)
        torch.testing.assert_close(y[ok], ref[ok], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_generic_bf16_every_size(approximate, threads, request):
    g, specs = built(make_gelu, None, approximate, BF16)
    assert [(s.numel, s.dtype) for s in specs] == [(0, "bf16")]
    table = g(ALL_BF16)
    assert_gelu_bf16_matches_aten(ALL_BF16, table, approximate)
    torch.manual_seed(6)
    x = ALL_BF16[torch.randint(0, 65536, (max(NUMELS),))]  # NaN and the other specials too
    request.getfixturevalue("no_new_kernels")
    for n in NUMELS:
        y = g(x[:n])
        assert y.dtype == BF16 and y.shape == (n,)
        assert_bits_equal(y, table[bits(x[:n]).long()])
    assert_gelu_bf16_matches_aten(x, g(x), approximate)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("op", ["gelu", "gelu_tanh", "relu", "exp", "erf", "tanh"])
def test_generic_eltwise_equals_specialised(op, dtype, threads):
    """The generic kernel computes what the size-specialised one does, bit for bit."""
    torch.manual_seed(7)
    x = (torch.randn(70_001) * 5).to(dtype)
    x[::1000] = float("nan")
    gen, spec = make_eltwise(op, None, dtype)(x), make_eltwise(op, x.numel(), dtype)(x)
    assert torch.equal(gen.view(torch.int16) if dtype == BF16 else gen.view(torch.int32),
                       spec.view(torch.int16) if dtype == BF16 else spec.view(torch.int32))


def test_gelu_generic_shapes_and_slow_path():
    g = make_gelu(None)
    x = torch.randn(3, 5, 7)
    assert g(x).shape == (3, 5, 7) and g(torch.empty(0, 4)).shape == (0, 4)
    torch.testing.assert_close(g(x.transpose(0, 2)), F.gelu(x.transpose(0, 2)), rtol=1e-4,
                               atol=1e-5)
    with pytest.raises(NotImplementedError):
        g(x.double())
    with pytest.raises(ValueError):
        make_gelu(0)


# ---- fused GEMM + top-k ---------------------------------------------------------------------

def tied(n, kd, lo=-2, hi=3, dtype=torch.float32):
    """Small-integer weights whose rows repeat (many equal scores; every score exact)."""
    base = torch.randint(lo, hi, (n // 7 + 1, kd)).float()
    return base.repeat(7, 1)[:n][torch.randperm(n)].to(dtype)


KINDS = {  # name -> make_linear_topk keywords, dtype of x and W
    "f32": ({"screen": False}, torch.float32),
    "bf16": ({"dtype": BF16}, BF16),
    "f32_screen": ({"screen": True}, torch.float32),
}


def kind(name):
    if name == "f32_screen" and not HAS_BF16:
        pytest.skip("bf16 screening needs AVX512_BF16")
    return KINDS[name]


@pytest.mark.parametrize("name", sorted(KINDS))
@pytest.mark.parametrize("largest", [True, False])
def test_topk_generic_ties_every_row_count(name, largest, threads, request):
    """Tie-heavy exact scores: indices and values equal torch.topk's at every row count."""
    kwargs, dtype = kind(name)
    torch.manual_seed(8)
    kd = 64 if name == "f32_screen" else 16
    w = tied(3001, kd, dtype=dtype)
    f, specs = built(make_linear_topk, w, None, 40, largest, **kwargs)
    # on a CPU with tiles the tile path's kernel takes the many rows; with AVX512_VNNI the
    # int8 screen's the few of a screened float32 top-k; the vector path's any others
    tiles = name != "f32" and bool(host_target().tiles)
    int8 = name == "f32_screen" and topk._int8_screens(kd, host_target())
    paths = ["vector"] * int8 + ["vector"] * (not (int8 and tiles)) + ["tile"] * tiles
    assert [s.path for s in specs] == paths and all(s.m == 0 for s in specs) and f.spec.m == 0
    assert (specs[0].approx == "int8") == int8
    x = torch.randint(-8, 9, (max(ROWS), kd)).float()
    if name == "f32_screen":
        x = x * (1025 / 1024)  # exact in float32, not in bf16: the bound must work
    x = x.to(dtype)
    scores = x @ w.t()
    request.getfixturevalue("no_new_kernels")
    for m in ROWS:
        v, i = f(x[:m])
        rv, ri = torch.topk(scores[:m], 40, largest=largest)
        assert v.dtype == dtype and i.dtype == torch.int64 and v.shape == (m, 40)
        assert torch.equal(i, ri) and torch.equal(v, rv), (name, m)


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_topk_generic_nan_scores(name, threads):
    kwargs, dtype = kind(name)
    torch.manual_seed(9)
    w = torch.randint(-3, 4, (2000, 8)).float()
    w[[5, 700, 1999]] = float("nan")
    w = w.to(dtype)
    x = torch.randint(-3, 4, (67, 8)).float().to(dtype)
    for largest in (True, False):
        f = make_linear_topk(w, None, 20, largest, **kwargs)
        for m in (1, 2, 7, 8, 9, 31, 67):
            v, i = f(x[:m])
            rv, ri = torch.topk(x[:m] @ w.t(), 20, largest=largest)
            assert torch.equal(i, ri) and torch.equal(torch.isnan(v), torch.isnan(rv))


@pytest.mark.parametrize("screen", [False, True])
def test_topk_generic_random_f32(screen, threads):
    """Random scores (odd K, N off the panel width): as the specialised tests check them."""
    if screen and not HAS_BF16:
        pytest.skip("bf16 screening needs AVX512_BF16")
    torch.manual_seed(10)
    w, x = torch.randn(5003, 37) / 37 ** 0.5, torch.randn(257, 37)
    f = make_linear_topk(w, None, 25, screen=screen)
    assert f.spec.approx in (("bf16", "int8") if screen else ("none",))
    for m in (1, 3, 5, 8, 13, 17, 64, 257):
        v, i = f(x[:m])
        scores = x[:m] @ w.t()
        rv, ri = torch.topk(scores, 25)
        torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, torch.gather(scores, 1, i), rtol=1e-4, atol=1e-5)
        assert all(len(set(r.tolist())) == 25 for r in i)
        assert (i == ri).float().mean().item() >= 0.99


@pytest.mark.parametrize("m", [1, 7, 9, 67])
def test_topk_generic_bf16_equals_unfused(m, threads):
    """Random bf16 (odd K: the zero column): torch.topk of the unfused linear's bf16 scores."""
    torch.manual_seed(11 + m)
    w = torch.randn(3001, 33).to(BF16)
    w = torch.cat([w[:300].repeat(10, 1), w[:1]])  # repeated items: tied scores
    x = torch.randn(m, 33).to(BF16)
    v, i = make_linear_topk(w, None, 5, False)(x)
    rv, ri = torch.topk(make_linear(w, None, m, dtype=BF16)(x), 5, dim=-1, largest=False)
    assert torch.equal(v, rv) and torch.equal(i, ri)


def test_topk_generic_edges_of_the_interface():
    torch.manual_seed(12)
    w = torch.randn(3000, 16)
    f = make_linear_topk(w, None, 10)
    v, i = f(torch.randn(0, 16))
    assert v.shape == (0, 10) and i.shape == (0, 10)
    x = torch.randn(9, 32)[:, ::2]  # non-contiguous: the checked slow path
    torch.testing.assert_close(f(x)[0], torch.topk(x @ w.t(), 10).values)
    for bad in (torch.randn(3, 15), torch.randn(16)):
        with pytest.raises(ValueError):
            f(bad)
    with pytest.raises(NotImplementedError):
        f(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(ValueError):
        make_linear_topk(w, 0, 10)


def test_topk_generic_large_k_goes_through_torch_topk():
    torch.manual_seed(13)
    w, x = torch.randn(300, 16), torch.randn(70, 16)
    f = make_linear_topk(w, None, 100)  # k * 64 > n: the unfused linear, generic too
    assert f.spec.m == 0
    for m in (1, 5, 70):
        v, i = f(x[:m])
        scores = x[:m] @ w.t()
        torch.testing.assert_close(v, torch.topk(scores, 100).values, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v, torch.gather(scores, 1, i), rtol=1e-4, atol=1e-5)


def test_topk_spec_symbols_name_screening_and_dtype_apart():
    """Two kernels loaded in one process must not export the same symbol: the bf16 screening
    of float32 scores and bf16 operands differ in code, so in name too."""
    from kwker.kernels.specs import TopkGemmSpec
    specs = [TopkGemmSpec(m, 100, 16, 5, approx=a, dtype=d)
             for m in (0, 8) for a in ("none", "bf16") for d in ("f32", "bf16")]
    assert len({s.symbol for s in specs}) == len(specs)
