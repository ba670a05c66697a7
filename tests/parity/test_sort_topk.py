"""sort / argsort / msort / topk: Kwker vs ATen, bit for bit (values, indices, strides)."""
import pytest
import torch

import kwker.torch_ops as kto

from .inputs import DTYPES, assert_identical, make, patterns

SIZES = (1, 2, 3, 5, 8, 15, 16, 17, 31, 33, 40, 64, 65, 100, 129, 1000)


def both(fn):
    want = fn()
    with kto.accelerated():
        got = fn()
    return got, want


def check(fn, what=""):
    got, want = both(fn)
    assert_identical(got, want, what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sort_all_patterns(dtype, kernels_everywhere):
    for pattern in patterns(dtype):
        for n in SIZES:
            x = make(pattern, (3, n), dtype, seed=n)
            for desc in (False, True):
                for stable in (False, True):
                    check(lambda: torch.sort(x, dim=-1, descending=desc, stable=stable),
                          f"sort {pattern} n={n} desc={desc} stable={stable}")
            check(lambda: torch.argsort(x, dim=1, descending=True), f"argsort {pattern} {n}")
            check(lambda: torch.msort(x.t()), f"msort {pattern} {n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_nan_payloads_and_signed_zeros_keep_their_bits(dtype, kernels_everywhere):
    """Sorted float values are written from their keys where the key tells the value, and
    gathered from the row where it does not: NaNs (one key, any payload and sign) and ±0."""
    x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(0), dtype=dtype)
    if dtype == torch.float32:
        bits = x.view(torch.int32)
        bits[:, ::7] = 0x7FC01234            # NaN with a payload
        bits[:, 3::11] = -0x7FC00000 + 0x55  # negative NaN with a payload
    else:
        bits = x.view(torch.int64)
        bits[:, ::7] = 0x7FF8000000001234
        bits[:, 3::11] = -0x7FF8000000000000 + 0x55
    x[:, 5::13], x[:, 6::17] = -0.0, 0.0
    for desc in (False, True):
        for stable in (False, True):
            check(lambda: torch.sort(x, descending=desc, stable=stable),
                  f"sort desc={desc} stable={stable}")
    for k in (10, 700):
        check(lambda: torch.topk(x, k), f"topk {k}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.bfloat16, torch.int16],
                         ids=str)
def test_rows_of_a_few_values_in_skewed_proportions(dtype, kernels_everywhere):
    """Introsort's partitions where one scan stops at every position it reaches (the pivot is
    the range's largest or smallest key) and its all-equal ranges take shortcuts
    (sort_partition.py, sort_equal.py). Rows of 2-50 values in skewed proportions reach them in
    every mix, and stop them midway: a third key among the dense side's words."""
    g = torch.Generator().manual_seed(7)
    for values in (2, 3, 5, 50):
        for skew in (1, 4, 12):
            probs = torch.rand(values, generator=g) ** skew
            for n in (300, 4097):
                x = torch.multinomial(probs / probs.sum(), 3 * n, replacement=True,
                                      generator=g).reshape(3, n).to(dtype)
                for desc in (False, True):
                    check(lambda: torch.sort(x, descending=desc),
                          f"sort {values} values, skew {skew}, n={n} desc={desc}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_all_patterns(dtype, kernels_everywhere):
    for pattern in patterns(dtype):
        for n in SIZES:
            x = make(pattern, (3, n), dtype, seed=n)
            for k in sorted({1, 2, max(1, n // 64), n // 64 + 1, n // 2 or 1, n} - {n + 1}):
                for largest in (True, False):
                    for srt in (True, False):
                        check(lambda: torch.topk(x, k, largest=largest, sorted=srt),
                              f"topk {pattern} n={n} k={k} largest={largest} sorted={srt}")


@pytest.mark.parametrize("n", (20000, 100000))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.int64, torch.int16),
                         ids=str)
def test_large_rows(n, dtype, kernels_everywhere):
    for pattern in ("normal", "ties4", "ties_nan", "signed_zero", "descending"):
        if pattern in ("ties_nan", "signed_zero") and not dtype.is_floating_point:
            continue
        x = make(pattern, (2, n), dtype, seed=1)
        check(lambda: torch.sort(x), f"sort {pattern}")
        check(lambda: torch.sort(x, descending=True, stable=True), f"stable desc {pattern}")
        for k in (10, n // 64, n // 64 + 1, n // 3):
            check(lambda: torch.topk(x, k), f"topk {pattern} k={k}")
            check(lambda: torch.topk(x, k, largest=False, sorted=False), f"topk small {k}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.int64, torch.int32),
                         ids=str)
def test_stable_sort_keys_differing_in_some_digits(dtype, kernels_everywhere):
    """The radix sort counts only the digits in which a row's keys differ (the rest get their
    one count without a pass): keys apart in their low bits only, in one middle digit, in the
    sign alone, in the top bits, or not at all, in rows of a network's size and beyond; and
    in each 11-bit digit but not in each byte (long rows of 32-bit keys then take byte
    digits, one of them skipped)."""
    g = torch.Generator().manual_seed(7)
    for n in (40, 700, 20000):
        pick = torch.randint(0, 3, (2, n), generator=g)
        for name, values in (("low bits", [1 << 30, (1 << 30) + 1, (1 << 30) + 3]),
                             ("middle digit", [1 << 30, (1 << 30) + (1 << 15), 1 << 30]),
                             ("sign", [-5, 5, 5]), ("top bits", [0, 1 << 28, 3 << 28]),
                             ("11-bit digits", [1 << 30, (1 << 30) + 1 + (1 << 25),
                                                (1 << 30) + (1 << 12)]),
                             ("equal", [7, 7, 7])):
            x = torch.tensor(values, dtype=torch.int64)[pick]
            x = x.view(torch.int32).view(torch.float32)[:, ::2] if dtype == torch.float32 \
                else x.view(torch.float64) if dtype == torch.float64 else x.to(dtype)
            for desc in (False, True):
                check(lambda: torch.sort(x, descending=desc, stable=True),
                      f"{name} n={n} desc={desc}")


@pytest.mark.parametrize("dtype", (torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8), ids=str)
def test_radix_path_1d(dtype, kernels_everywhere):
    """1-D ascending integer sorts of >= 32768 elements are stable in ATen (FBGEMM radix)."""
    for pattern in ("normal", "ties4", "equal"):
        x = make(pattern, (40000,), dtype, seed=3)
        check(lambda: torch.sort(x), f"radix {pattern}")
        check(lambda: torch.sort(x, descending=True), f"1-D descending {pattern}")
        check(lambda: torch.sort(x.reshape(1, -1)), f"2-D {pattern}")


def test_every_dim_and_layout(kernels_everywhere):
    shapes = [(70,), (5, 70), (3, 4, 70), (2, 3, 4, 70)]
    for shape in shapes:
        base = make("ties4", shape, torch.float32, seed=len(shape)).float()
        views = {"contiguous": base,
                 "transposed": base.transpose(0, -1) if base.dim() > 1 else base,
                 "sliced": base[..., ::2],
                 "permuted": base.permute(*reversed(range(base.dim())))}
        for name, x in views.items():
            for dim in range(-x.dim(), x.dim()):
                what = f"{shape} {name} dim={dim}"
                check(lambda: torch.sort(x, dim=dim), "sort " + what)
                check(lambda: torch.sort(x, dim=dim, stable=True, descending=True),
                      "stable " + what)
                k = min(3, x.shape[dim])
                check(lambda: torch.topk(x, k, dim=dim), "topk " + what)


def test_expanded_input_keeps_arange_indices():
    x = torch.tensor([[2.0], [1.0]]).expand(2, 50)
    check(lambda: torch.sort(x), "expanded sort")
    check(lambda: torch.topk(x, 5), "expanded topk")


def test_out_variants(kernels_everywhere):
    x = make("ties4", (4, 100), torch.float32)
    for vshape in ((0,), (4, 100), (3,)):
        def run():
            v, i = torch.empty(vshape), torch.empty(vshape, dtype=torch.long)
            torch.sort(x, dim=1, descending=True, out=(v, i))
            v2, i2 = torch.empty(vshape), torch.empty(vshape, dtype=torch.long)
            torch.topk(x, 7, out=(v2, i2))
            return v, i, v2, i2
        with pytest.warns(UserWarning) if vshape == (3,) else _nothing():
            got, want = both(run)
        assert_identical(got, want, f"out {vshape}")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("threads", (2, 5))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64, torch.int32), ids=str)
def test_long_row_split_over_threads(dtype, threads, kernels_everywhere):
    """One row of >= 100000 elements is partitioned, then its ranges sort on several threads
    (5 threads: three partition levels, eight ranges)."""
    torch.set_num_threads(threads)
    for pattern in ("normal", "ties4", "ties_nan", "descending", "equal"):
        if pattern == "ties_nan" and not dtype.is_floating_point:
            continue
        x = make(pattern, (150_001,), dtype, seed=4)
        check(lambda: torch.sort(x), f"long sort {pattern}")
        check(lambda: torch.sort(x, descending=True), f"long sort desc {pattern}")


def _planted(n: int, pairs: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct values with ``pairs`` planted ties (among them a NaN pair and a -0.0/+0.0
    pair for floats), some at the row's ends."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randperm(n, generator=g) - n // 2).double()
    spots = torch.randperm(n, generator=g)[:2 * pairs].tolist()
    if pairs:
        spots[:2] = [0, n - 1]
    for a, b in zip(spots[::2], spots[1::2]):
        x[a] = x[b]
    if dtype.is_floating_point and pairs >= 3:
        x[spots[2]], x[spots[3]] = float("nan"), float("nan")
        x[spots[4]], x[spots[5]] = -0.0, 0.0
    return x.to(dtype)


@pytest.mark.parametrize("presort", (True, False), ids=("presort", "introsort"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.int32, torch.float16), ids=str)
def test_rows_sorted_first_where_no_key_ties(dtype, presort, kernels_everywhere, monkeypatch):
    """Unstable sorts of 32-bit keys radix-sort the row first; introsort runs exactly only on
    ranges holding a tied key (sort_presorted.py): rows with no, one or a few ties, on one
    thread and one long row split over threads; and with the switch off, introsort alone."""
    from kwker.ops import sorting
    monkeypatch.setitem(sorting.SWITCHES, "presort", presort)
    n = 2048 if dtype == torch.float16 else 20000  # float16 holds 2048 integers exactly
    for pairs in (0, 1, 3, 12):
        x = torch.stack([_planted(n, pairs, dtype, seed) for seed in range(3)])
        for desc in (False, True):
            check(lambda: torch.sort(x, descending=desc), f"rows pairs={pairs} desc={desc}")
        check(lambda: torch.argsort(x.t(), dim=0), f"argsort of a view pairs={pairs}")
    torch.set_num_threads(2)
    for pairs in (0, 1, 40):
        x = _planted(150_001 if dtype != torch.float16 else 2048, pairs, dtype, seed=7)
        check(lambda: torch.sort(x), f"long row pairs={pairs}")
        check(lambda: torch.sort(x, descending=True), f"long row desc pairs={pairs}")
