"""kthvalue / median / nanmedian / mode / quantile / nanquantile: Kwker vs ATen, bit for bit."""
import pytest
import torch

from .inputs import DTYPES, FLOATS, make, patterns
from .test_sort_topk import check

SIZES = (1, 2, 3, 4, 5, 8, 16, 17, 25, 33, 40, 64, 100, 257, 1000)
INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_selection_ops(dtype, kernels_everywhere):
    for pattern in patterns(dtype):
        for n in SIZES:
            x = make(pattern, (3, n), dtype, seed=n)
            for k in sorted({1, (n + 1) // 2, n}):
                check(lambda: torch.kthvalue(x, k, dim=1), f"kthvalue {pattern} n={n} k={k}")
            check(lambda: torch.median(x, dim=1), f"median(dim) {pattern} n={n}")
            check(lambda: torch.nanmedian(x, dim=1, keepdim=True), f"nanmedian(dim) {pattern}")
            check(lambda: torch.median(x), f"median() {pattern} n={n}")
            check(lambda: torch.nanmedian(x), f"nanmedian() {pattern} n={n}")
            check(lambda: torch.mode(x, dim=1), f"mode {pattern} n={n}")


def test_all_nan_rows(kernels_everywhere):
    for n in range(1, 30):
        x = torch.full((2, n), float("nan"))
        check(lambda: torch.nanmedian(x, dim=1), f"nanmedian all-NaN n={n}")
        check(lambda: torch.nanmedian(x), f"nanmedian() all-NaN n={n}")
        check(lambda: torch.kthvalue(x, (n + 1) // 2), f"kthvalue all-NaN n={n}")
        check(lambda: torch.mode(x), f"mode all-NaN n={n}")


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_quantiles(dtype, kernels_everywhere):
    qs = torch.tensor([0.0, 0.1, 0.25, 1 / 3, 0.5, 0.7, 0.99, 1.0], dtype=dtype)
    for pattern in patterns(dtype):
        for n in SIZES:
            x = make(pattern, (3, n), dtype, seed=n)
            for interp in INTERPOLATIONS:
                what = f"{pattern} n={n} {interp}"
                check(lambda: torch.quantile(x, qs, dim=1, interpolation=interp), "q " + what)
                check(lambda: torch.nanquantile(x, qs, dim=1, interpolation=interp),
                      "nanq " + what)
                check(lambda: torch.quantile(x, 0.3, interpolation=interp), "q scalar " + what)
                check(lambda: torch.nanquantile(x, 0.6, dim=0, keepdim=True,
                                                interpolation=interp), "nanq dim0 " + what)


@pytest.mark.parametrize("dtype", (torch.float32, torch.int64, torch.uint8), ids=str)
def test_large_rows(dtype, kernels_everywhere):
    for pattern in ("normal", "ties4", "ties_nan", "signed_zero"):
        if pattern in ("ties_nan", "signed_zero") and not dtype.is_floating_point:
            continue
        x = make(pattern, (2, 20000), dtype, seed=2)
        for k in (1, 777, 10000, 20000):
            check(lambda: torch.kthvalue(x, k), f"kthvalue {pattern} k={k}")
        check(lambda: torch.median(x, 1), f"median {pattern}")
        check(lambda: torch.nanmedian(x, 1), f"nanmedian {pattern}")
        check(lambda: torch.median(x), f"median() {pattern}")
        check(lambda: torch.mode(x, 1), f"mode {pattern}")
        if dtype.is_floating_point:
            q = torch.tensor([0.1, 0.5, 0.9])
            check(lambda: torch.quantile(x, q, dim=1), f"quantile {pattern}")
            check(lambda: torch.nanquantile(x, q, dim=1), f"nanquantile {pattern}")


def test_every_dim_and_layout(kernels_everywhere):
    for shape in [(70,), (5, 70), (3, 4, 70), (2, 3, 4, 70)]:
        base = make("ties4", shape, torch.float64, seed=len(shape))
        for name, x in {"contiguous": base, "transposed": base.transpose(0, -1),
                        "sliced": base[..., ::2]}.items():
            for dim in range(-x.dim(), x.dim()):
                for keepdim in (False, True):
                    what = f"{shape} {name} dim={dim} keepdim={keepdim}"
                    check(lambda: torch.kthvalue(x, 2, dim, keepdim), "kthvalue " + what)
                    check(lambda: torch.median(x, dim, keepdim), "median " + what)
                    check(lambda: torch.nanmedian(x, dim, keepdim), "nanmedian " + what)
                    check(lambda: torch.mode(x, dim, keepdim), "mode " + what)
                    check(lambda: torch.quantile(x, torch.tensor([0.2, 0.8], dtype=x.dtype),
                                                 dim, keepdim), "quantile " + what)
            check(lambda: torch.quantile(x, 0.4, None, True), f"quantile None {shape}")


def test_expanded_median_is_correct():
    """ATen's median(x, dim) on a stride-0 input is a known torch bug; Kwker is right."""
    x = torch.tensor([[3.0], [1.0], [2.0]]).expand(3, 80)
    with __import__("kwker.torch_ops").torch_ops.accelerated():
        got = torch.median(x, dim=1)
    want = torch.median(x.contiguous(), dim=1)
    assert torch.equal(got.values, want.values) and torch.equal(got.indices, want.indices)


def test_quantile_nan_payloads_and_signed_zeros(kernels_everywhere):
    """Which NaN (payload) or which zero a quantile picks depends on std::sort's tie order."""
    g = torch.Generator().manual_seed(1)
    q = torch.tensor([0.0, 0.3, 0.5, 1.0])
    for n in (1, 2, 5, 17, 40, 300):
        x = torch.randint(-2, 3, (3, n), generator=g).float()
        r = torch.rand(3, n, generator=g)
        x[r < 0.2] = float("nan")
        x.view(torch.int32)[r < 0.1] = -4194304  # 0xffc00000: a NaN with the sign bit set
        x[(x == 0) & (r > 0.6)] = -0.0
        for interp in INTERPOLATIONS:
            check(lambda: torch.quantile(x, q, dim=1, interpolation=interp), f"q {n} {interp}")
            check(lambda: torch.nanquantile(x, q, dim=1, interpolation=interp),
                  f"nanq {n} {interp}")
