"""make_linear_topk against torch.topk(x @ W.T): values, and ATen's tie order on equal scores."""
import pytest
import torch

from kwker.kernels import topk
from kwker.kernels.topk import make_linear_topk


def check(w, x, k, largest, exact, fn=None):
    """``fn`` (default: ``make_linear_topk``'s choice) against torch.topk of the scores."""
    m = x.shape[0]
    v, i = (fn or make_linear_topk(w, m, k, largest))(x)
    scores = x @ w.t()
    rv, ri = torch.topk(scores, k, largest=largest)
    assert v.shape == (m, k) and i.dtype == torch.int64
    torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)
    # our values are the scores at our indices, and every index is distinct per row
    torch.testing.assert_close(v, torch.gather(scores, 1, i), rtol=1e-4, atol=1e-5)
    assert all(len(set(r.tolist())) == k for r in i)
    if exact:
        assert torch.equal(i, ri) and torch.equal(v, rv)
    else:
        assert (i == ri).float().mean().item() >= 0.99


@pytest.mark.parametrize("m,n,kd,k", [(32, 20000, 128, 10), (1, 20000, 128, 10),
                                      (3, 1000, 13, 5), (13, 7000, 127, 100), (1, 641, 7, 10),
                                      (9, 6400, 64, 17), (20, 130, 3, 2)])
@pytest.mark.parametrize("largest", [True, False])
def test_linear_topk_random(m, n, kd, k, largest, threads):
    torch.manual_seed(m + n + k)
    check(torch.randn(n, kd) / kd ** 0.5, torch.randn(m, kd), k, largest, exact=False)


@pytest.mark.parametrize("m", [1, 9, 24])
@pytest.mark.parametrize("largest", [True, False])
def test_linear_topk_ties_match_aten_exactly(m, largest, threads):
    """Small integers make every score exact and ties plentiful: indices must equal ATen's."""
    torch.manual_seed(m)
    w = torch.randint(-2, 3, (3000, 16)).float()
    x = torch.randint(-2, 3, (m, 16)).float()
    check(w, x, 40, largest, exact=True)


def test_linear_topk_all_equal_scores(threads):
    w = torch.ones(4096, 8)
    x = torch.ones(5, 8)
    check(w, x, 50, True, exact=True)


def test_linear_topk_nan_scores(threads):
    torch.manual_seed(9)
    w = torch.randint(-3, 4, (2000, 8)).float()
    w[[5, 700, 1999]] = float("nan")
    x = torch.randint(-3, 4, (4, 8)).float()
    for largest in (True, False):
        v, i = make_linear_topk(w, 4, 20, largest)(x)
        rv, ri = torch.topk(x @ w.t(), 20, largest=largest)
        assert torch.equal(i, ri)
        assert torch.equal(torch.isnan(v), torch.isnan(rv))


def test_linear_topk_large_k_uses_topk_on_scores():
    torch.manual_seed(10)
    w, x = torch.randn(300, 16), torch.randn(7, 16)
    check(w, x, 100, True, exact=False)  # k * 64 > n: ATen's selection path


needs_bf16 = pytest.mark.skipif(
    not __import__("kwker.runtime.target", fromlist=["host_target"]).host_target()
    .has("avx512bf16"), reason="bf16 screening needs AVX512_BF16")


@needs_bf16
@pytest.mark.parametrize("m", [1, 9, 24])
@pytest.mark.parametrize("largest", [True, False])
def test_bf16_screening_is_exact(m, largest, threads):
    """Scores exact in float32 but not in bf16 (x = integer * 1025/1024), full of ties: the
    screened kernel must return ATen's indices and values bit for bit."""
    torch.manual_seed(100 + m)
    w = torch.randint(-3, 4, (3000, 64)).float()
    x = torch.randint(-8, 9, (m, 64)).float() * (1025 / 1024)
    v, i = make_linear_topk(w, m, 40, largest, screen=True)(x)
    rv, ri = torch.topk(x @ w.t(), 40, largest=largest)
    assert torch.equal(i, ri) and torch.equal(v, rv)


@needs_bf16
def test_bf16_screening_odd_k_and_edges(threads):
    """Odd K, N off the panels: the screen chosen here (int8 on matrix tiles with AVX512_VNNI)
    and the bf16 one on the same path."""
    torch.manual_seed(11)
    w, x = torch.randn(5003, 37), torch.randn(13, 37)
    f = make_linear_topk(w, 13, 25, True, screen=True)
    assert f.spec.approx in ("bf16", "int8")
    check(w, x, 25, True, exact=False, fn=f)
    bf16 = topk._build(w, 13, 25, True, torch.float32, False, "bf16", f.spec.path == "tile")
    check(w, x, 25, True, exact=False, fn=bf16)


@needs_bf16
@pytest.mark.parametrize("sx,sw", [(1e-20, 1e-20), (1e-30, 1e10), (1e15, 1e15)])
def test_bf16_screening_extreme_magnitudes(sx, sw):
    """Denormal products (flushed by vdpbf16ps) and huge ones stay inside the bound."""
    torch.manual_seed(12)
    w, x = torch.randn(3000, 64) * sw, torch.randn(5, 64) * sx
    v, i = make_linear_topk(w, 5, 10, screen=True)(x)
    rv, ri = torch.topk(x @ w.t(), 10)
    assert (i == ri).float().mean().item() >= 0.99
    torch.testing.assert_close(v, rv, rtol=1e-4, atol=0)


@needs_bf16
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("largest", [True, False])
def test_int8_screening_is_exact(m, largest, threads):
    """One to four rows screen with int8 weights (vpdpbusd): tie-heavy scores exact in float32,
    ATen's indices and values bit for bit."""
    torch.manual_seed(200 + m)
    w = torch.randint(-3, 4, (3000, 64)).float() * 0.25
    x = torch.randint(-8, 9, (m, 64)).float() * (1025 / 1024)
    f = make_linear_topk(w, m, 40, largest, screen=True)
    assert f.spec.approx == "int8"
    v, i = f(x)
    rv, ri = torch.topk(x @ w.t(), 40, largest=largest)
    assert torch.equal(i, ri) and torch.equal(v, rv)


def with_special_values(case: str, w: torch.Tensor, x: torch.Tensor):
    """(w, x) with the special values ``case`` names written in (in place): NaN or inf in
    weights, NaN in a query, a zero query, zero weight rows."""
    if case == "nan_w":
        w[[3, 777, w.shape[0] - 1], 5] = float("nan")
    elif case == "inf_w":
        w[[10, 11], 0] = float("inf")
        w[12, 1] = float("-inf")
    elif case == "nan_x":
        x[1, 7] = float("nan")
    elif case == "zero_x":
        x[0] = 0.0
    elif case == "zero_rows":
        w[::7] = 0.0
    return w, x


@needs_bf16
@pytest.mark.parametrize("case", ["nan_w", "inf_w", "nan_x", "zero_x", "zero_rows"])
def test_int8_screening_non_finite_and_zero(case, threads):
    """Rows the int8 bound cannot cover (NaN, inf) always pass the screen; the answers are
    ATen's, NaN included."""
    torch.manual_seed(300)
    w, x = with_special_values(case, torch.randn(2000, 48), torch.randn(2, 48))
    f = make_linear_topk(w, 2, 10, screen=True)
    assert f.spec.approx == "int8"
    v, i = f(x)
    rv, ri = torch.topk(x @ w.t(), 10)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=0, equal_nan=True)


@needs_bf16
@pytest.mark.parametrize("sx,sw", [(1e-40, 1.0), (1e-20, 1e-20), (1e-30, 1e10), (1e15, 1e15),
                                   (1.0, 1e-42)])
def test_int8_screening_extreme_magnitudes(sx, sw):
    """Subnormal and huge scales: the bound's underflow slack and overflow guard hold."""
    torch.manual_seed(13)
    w, x = torch.randn(3000, 64) * sw, torch.randn(1, 64) * sx
    f = make_linear_topk(w, 1, 10, screen=True)
    assert f.spec.approx == "int8"
    v, i = f(x)
    rv, ri = torch.topk(x @ w.t(), 10)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=0)


@needs_bf16
@pytest.mark.parametrize("m", [1, 3])
def test_int8_screening_close_scores(m, threads):
    """Scores closer together than int8's quantisation error (rows perturbations of one row):
    only the error bound keeps the true top-k in; any shortfall would change the indices."""
    torch.manual_seed(400 + m)
    base = torch.randn(1, 96)
    w = (base + 1e-3 * torch.randn(4000, 96)) * (1 + 1e-3 * torch.randn(4000, 1))
    x = torch.randn(m, 96)
    f = make_linear_topk(w, m, 20, screen=True)
    assert f.spec.approx == "int8"
    v, i = f(x)
    rv, ri = torch.topk(x @ w.t(), 20)
    assert torch.equal(i, ri)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=0)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("half", [False, True], ids=["float32", "bf16"])
def test_every_variant_the_tuner_measures_is_exact(m, half):
    """Each screen and path the tuner may pick for ``m`` rows on this CPU (kernels/topk.py
    ``_paths``) returns torch.topk's values and tie order on tie-heavy scores."""
    from kwker.kernels import topk as T
    from kwker.kernels.linear import make_linear
    torch.manual_seed(m)
    dt = torch.bfloat16 if half else torch.float32
    w = torch.randint(-2, 3, (3001, 48)).float().to(dt)
    x = torch.randint(-2, 3, (m, 48)).float().to(dt)
    scores = make_linear(w, None, m, dtype=dt)(x) if half else x @ w.t()
    for largest in (True, False):
        rv, ri = torch.topk(scores, 10, largest=largest)
        for name, (approx, tiles) in T._paths(m, 48, half, None, T.host_target()).items():
            v, i = T._build(w, m, 10, largest, dt, half, approx, tiles)(x)
            assert torch.equal(i, ri) and torch.equal(v, rv), (name, largest)


def _buffer_ptrs(fn) -> set:
    """data_ptrs of the packed buffers a kernel (or a generic one's parts) holds."""
    held = fn.buffers if isinstance(fn.buffers, tuple) else (fn.buffers,)
    return {t.data_ptr() for bufs in held for t in bufs if t is not None}


def test_kernels_of_one_parameter_share_its_packed_weights():
    """A generic and a row-specialised kernel of one parameter (a dynamic graph and the graph
    dynamo adds for one size) read one packed copy per layout, and an in-place update of the
    parameter packs it again: results stay those of torch.topk on the new values."""
    torch.manual_seed(5)
    w = torch.nn.Parameter(torch.randn(5000, 64) / 8, requires_grad=False)
    x = torch.randn(3, 64)
    first = make_linear_topk(w.detach(), None, 10, source=w)
    again = make_linear_topk(w.detach(), None, 10, source=w)
    assert _buffer_ptrs(first) == _buffer_ptrs(again)
    alone = make_linear_topk(w.detach(), None, 10)  # no source: a copy of its own
    assert not _buffer_ptrs(alone) - {w.data_ptr()} & _buffer_ptrs(first)
    check(w.detach(), x, 10, True, exact=False, fn=first)
    with torch.no_grad():
        w.mul_(-1)
    renewed = make_linear_topk(w.detach(), None, 10, source=w)
    assert _buffer_ptrs(renewed) - {w.data_ptr()} != _buffer_ptrs(first) - {w.data_ptr()}
    check(w.detach(), x, 10, True, exact=False, fn=renewed)
