"""make_linear / make_matmul against ATen: primes, m=1, edge tiles, epilogues, residual."""
import math

import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.linear import make_linear
from kwker.kernels.matmul import make_matmul

TOL = dict(rtol=1e-4, atol=1e-5)


def reference(x, w, b, epilogue, res):
    y = F.linear(x, w, b)
    if epilogue == "relu":
        y = torch.relu(y)
    elif epilogue in ("silu", "sigmoid", "tanh"):
        y = getattr(F, epilogue)(y)
    elif epilogue == "gelu":
        y = F.gelu(y)
    elif epilogue == "gelu_tanh":
        y = F.gelu(y, approximate="tanh")
    return y if res is None else y + res


def assert_close(y, ref, k):
    # float32 sums of k products: allow the rounding of the sum, scaled like the inputs
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5 * max(1.0, k ** 0.5))


@pytest.mark.parametrize("m,n,k", [
    (1, 7, 13), (1, 127, 1021), (7, 13, 127), (12, 32, 64), (13, 33, 17), (25, 1021, 7),
    (100, 65, 300), (127, 97, 130), (1, 4096, 64), (8, 300, 1000), (30, 200, 257)])
def test_linear_shapes(m, n, k, threads):
    torch.manual_seed(m * 1000 + n + k)
    w, b, x = torch.randn(n, k) / k ** 0.5, torch.randn(n), torch.randn(m, k)
    f = make_linear(w, b, m)
    assert_close(f(x), F.linear(x, w, b), k)


@pytest.mark.parametrize("epilogue", ["none", "relu", "silu", "sigmoid", "tanh", "gelu",
                                      "gelu_tanh"])
@pytest.mark.parametrize("m,bias,residual", [(1, True, False), (5, False, True),
                                             (29, True, True), (64, True, False)])
def test_linear_epilogues(epilogue, m, bias, residual):
    torch.manual_seed(7)
    n, k = 75, 53
    w, x = torch.randn(n, k) / k ** 0.5, torch.randn(m, k) * 2
    b = torch.randn(n) if bias else None
    r = torch.randn(m, n) if residual else None
    f = make_linear(w, b, m, epilogue, residual)
    y = f(x, r) if residual else f(x)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_close(y, reference(x, w, b, epilogue, r), k)


def test_gelu_tanh_epilogue_keeps_its_digits():
    """The float32 epilogue's tanh GELU is x / (1 + e**(-2z)): within 4e-6 relative of the
    exact value from x = -5 up, where ATen's 0.5 x (1 + tanh z) cancels (30% off near -5, so
    the old epilogue failed here), and ATen's specials (inf, NaN; -inf gives NaN). K = 1 and
    a weight of ones make each output one input, exactly."""
    x = torch.cat([torch.linspace(-12, 12, 24001),
                   torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-30, 88.0, -1e10])])
    f = make_linear(torch.ones(16, 1), None, x.numel(), "gelu_tanh")
    y = f(x[:, None])
    torch.testing.assert_close(y, y[:, :1].expand(-1, 16), rtol=0, atol=0, equal_nan=True)
    y = y[:, 0].double()
    exact = F.gelu(x.double(), approximate="tanh")
    special = ~torch.isfinite(x)
    assert torch.equal(torch.isnan(y), torch.isnan(F.gelu(x, approximate="tanh")))
    assert torch.equal(y[special & ~torch.isnan(y)], exact[special & ~torch.isnan(y)])
    near = torch.isfinite(x) & (x >= -5)
    assert ((y - exact)[near].abs() <= 4e-6 * exact[near].abs() + 1e-38).all()
    assert ((y - exact)[torch.isfinite(x) & (x < -5)].abs() <= 1e-7).all()


def test_gelu_erf_epilogue_is_as_close_as_atens():
    """The float32 epilogue's erf GELU takes Phi's tail from A&S 7.1.26: Phi within 3e-7 of the
    exact value on a dense grid (ATen's float32 GELU: 3.4e-7), so within 1e-6 relative for
    x >= 0 and 4e-7 |x| below; NaN for NaN and -inf (as ATen's formula), inf for inf (where
    ATen's vector code gives NaN)."""
    x = torch.cat([torch.linspace(-12, 12, 240001),
                   torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e-30, 88.0, -1e10])])
    y = make_linear(torch.ones(16, 1), None, x.numel(), "gelu")(x[:, None])
    torch.testing.assert_close(y, y[:, :1].expand(-1, 16), rtol=0, atol=0, equal_nan=True)
    y = y[:, 0].double()
    exact = F.gelu(x.double())
    assert torch.equal(torch.isnan(y), torch.isnan(x) | (x == -math.inf))
    special = ~torch.isfinite(x) & ~torch.isnan(y)
    assert torch.equal(y[special], exact[special])
    finite = torch.isfinite(x)
    pos, neg = finite & (x >= 0), finite & (x < 0)
    assert ((y - exact)[pos].abs() <= 1e-6 * exact[pos].abs()).all()
    assert ((y - exact)[neg].abs() <= 4e-7 * x[neg].abs().double()).all()


def test_linear_large_k_blocks(threads):
    """K spans several cache blocks: partial sums go through C between blocks."""
    torch.manual_seed(3)
    m, n, k = 40, 70, 1500
    w, b, x = torch.randn(n, k) / k ** 0.5, torch.randn(n), torch.randn(m, k)
    f = make_linear(w, b, m, "gelu")
    assert_close(f(x), F.gelu(F.linear(x, w, b)), k)


@pytest.mark.parametrize("m,n,k", [(24, 96, 8192), (1, 200, 6000), (130, 50, 3001)])
def test_long_k_sums_as_accurate_as_atens(m, n, k, threads):
    """Every blocking, and a runtime B, sums long K about as accurately as ATen (MKL's blocked
    sums) against float64: float sums restart every few hundred products, where one serial
    chain over K = 8192 was ~6x further off."""
    from kwker.kernels import blocking
    from kwker.kernels import linear as L
    torch.manual_seed(k)
    w, x = torch.randn(n, k) / k ** 0.5, torch.randn(m, k)
    exact = (x.double() @ w.double().T)

    def error(y):
        return (y.double() - exact).abs().max().item()
    bound = 2 * error(F.linear(x, w)) + 1e-7
    for name, blk in blocking.variants(m, n, k).items():
        run = L._build(blk, w, None, m, n, k, k, "none", False, torch.float32, None,
                       torch.float32, (m,))
        assert error(run(x)) <= bound, name
    assert error(make_linear(w, None)(x)) <= bound                    # generic rows
    assert error(make_matmul(m, k, n, b_transposed=True)(x, w)) <= bound   # runtime B


@pytest.mark.parametrize("m,n,k,epilogue,residual", [
    (2048, 64, 64, "none", False), (129, 257, 511, "gelu", True), (37, 33, 65, "relu", False),
    (61, 100, 3000, "silu", True), (61, 100, 1500, "gelu", True), (500, 10, 10, "none", False)])
def test_every_blocking_variant(m, n, k, epilogue, residual, threads):
    """Each blocking the tuner may pick (A packed per call or read in place, K in one block)
    gives the answer, whichever this host's built-in choice is; K = 3000 takes several K blocks
    (and, where a panel of it fits half of L2, one)."""
    from kwker.kernels import blocking
    from kwker.kernels import linear as L
    torch.manual_seed(m + n + k)
    w, b, x = torch.randn(n, k) / k ** 0.5, torch.randn(n), torch.randn(m, k)
    res = torch.randn(m, n) if residual else None
    options = blocking.variants(m, n, k)
    assert {blk.a_pack for blk in options.values()} == {True, False}
    first = next(iter(options.values()))
    assert ("vector, K whole" in options) == (first.kc < k and blocking._k_whole(first, k)
                                             is not None), options
    for name, blk in options.items():
        run = L._build(blk, w, b, m, n, k, k, epilogue, residual, torch.float32, None,
                       torch.float32, (m,))
        y = run(x, res) if residual else run(x)
        assert_close(y, reference(x, w, b, epilogue, res), k)


def test_leading_dims_taken_as_they_are():
    """``lead``: x, the residual and the output with their leading dims, as the lowering hands
    a (batch, seq, K) input over; another shape is refused with the one expected."""
    torch.manual_seed(5)
    w, b = torch.randn(24, 40) / 40 ** 0.5, torch.randn(24)
    for lead in ((1, 1), (2, 3), (4, 1, 5)):
        m = math.prod(lead)
        x, res = torch.randn(*lead, 40), torch.randn(*lead, 24)
        f = make_linear(w, b, m, "relu", True, lead=lead)
        assert_close(f(x, res), reference(x, w, b, "relu", res), 40)
        with pytest.raises(ValueError, match="expected shape"):
            f(x.reshape(m, 40), res.reshape(m, 24))
    with pytest.raises(ValueError, match="leading dims"):
        make_linear(w, b, 5, lead=(2, 3))


@pytest.mark.parametrize("dtype, k", [(torch.float32, 40), (torch.bfloat16, 40),
                                      (torch.bfloat16, 41)], ids=["f32", "bf16", "bf16-odd-k"])
def test_generic_kernel_takes_any_leading_dims(dtype, k):
    """A kernel generic over rows (``m=None``) takes x of any leading dims and gives the output
    with them, as ``F.linear`` (the lowering hands it a decoder's (batch, seq, K) as it is):
    one row, several, none, a 1-D x, a non-contiguous x (bf16 odd K: the checked path's
    padding); a residual of another shape is refused with the one expected."""
    torch.manual_seed(6)
    w, b = (torch.randn(24, k) / k ** 0.5).to(dtype), torch.randn(24).to(dtype)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    f = make_linear(w, b, None, "relu", True, dtype=dtype)
    g = make_linear(w, b, None, dtype=dtype)
    for lead in ((1, 1), (2, 3), (4, 1, 5), (0, 3), ()):
        x, res = torch.randn(*lead, k).to(dtype), torch.randn(*lead, 24).to(dtype)
        want = reference(x.float(), w.float(), b.float(), "relu", res.float())
        for y in (f(x, res), f(x.transpose(0, -1).contiguous().transpose(0, -1), res)):
            assert y.shape == (*lead, 24) and y.dtype == dtype
            torch.testing.assert_close(y.float(), want, **(tol or dict(rtol=1e-4, atol=1e-5)))
        assert g(x).shape == (*lead, 24)
    with pytest.raises(ValueError, match="expected shape"):
        f(torch.randn(2, 3, k).to(dtype), torch.randn(3, 2, 24).to(dtype))


def test_linear_keeps_weights_and_noncontiguous_input():
    torch.manual_seed(4)
    w = torch.randn(33, 20)
    kept = w.clone()
    f = make_linear(w, None, 6)
    w.zero_()  # packed at build time: later edits of the tensor do not leak in
    x = torch.randn(20, 6).t()  # non-contiguous
    assert_close(f(x), F.linear(x, kept), 20)


def test_linear_rejects_bad_input():
    f = make_linear(torch.randn(8, 4), None, 3)
    with pytest.raises(ValueError, match="shape"):
        f(torch.randn(2, 4))
    with pytest.raises(NotImplementedError):
        f(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(NotImplementedError):
        make_linear(torch.randn(8, 4, dtype=torch.float64), None, 3)


@pytest.mark.parametrize("m,k,n,batch,bt", [
    (1, 7, 13, 1, False), (3, 13, 7, 2, True), (13, 127, 101, 3, False), (64, 64, 64, 4, True),
    (100, 300, 65, 1, False), (8, 1024, 130, 1, True), (128, 32, 128, 9, False),
    (37, 41, 43, 2, True)])
def test_matmul(m, k, n, batch, bt, threads):
    torch.manual_seed(m + k + n)
    a = torch.randn(batch, m, k)
    b = torch.randn(batch, n, k) if bt else torch.randn(batch, k, n)
    f = make_matmul(m, k, n, batch, b_transposed=bt)
    assert_close(f(a, b), a @ (b.transpose(1, 2) if bt else b), k)


def test_matmul_2d():
    torch.manual_seed(1)
    a, b = torch.randn(9, 31), torch.randn(31, 17)
    f = make_matmul(9, 31, 17)
    assert f(a, b).shape == (9, 17)
    assert_close(f(a, b), a @ b, 31)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (1000, 1, 3), (2, 1000, 1), (9, 2, 2)])
def test_degenerate_shapes(m, n, k):
    torch.manual_seed(m + n + k)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
    assert_close(make_linear(w, b, m, "gelu")(x), F.gelu(F.linear(x, w, b)), k)
    a, bb = torch.randn(2, m, k), torch.randn(2, k, n)
    assert_close(make_matmul(m, k, n, 2)(a, bb), a @ bb, k)
    assert_close(make_matmul(m, k, n, 2, True)(a, bb.transpose(1, 2).contiguous()), a @ bb, k)
