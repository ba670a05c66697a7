"""Hypothesis: random shapes, dims and values drawn from tie-heavy, NaN, +-0, +-inf pools."""
import resource

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kwker.ops.sorting as sorting
import kwker.torch_ops as kto
from kwker.ops import rows

from .test_sort_topk import check

POOL = [0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan"), 1e-45, 3.0]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int16,
                                  torch.uint8]))
    shape = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    n = 1
    for s in shape:
        n *= s
    if dtype.is_floating_point:
        vals = draw(st.lists(st.sampled_from(POOL), min_size=n, max_size=n))
        x = torch.tensor(vals, dtype=dtype)
    else:
        x = torch.tensor(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), dtype=dtype)
    x = x.reshape(shape)
    if draw(st.booleans()) and x.dim() > 1:
        x = x.transpose(0, -1)
    return x, draw(st.integers(-x.dim(), x.dim() - 1))



@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors(), st.booleans(), st.booleans(), st.data())
def test_ops_match_aten(xd, flag_a, flag_b, data):
    x, dim = xd
    saved = sorting.MIN_NUMEL, sorting.MIN_ROW
    sorting.MIN_NUMEL = dict.fromkeys(sorting.MIN_NUMEL, 0)
    sorting.MIN_ROW = dict.fromkeys(sorting.MIN_ROW, 0)
    try:
        n = x.shape[dim]
        k = data.draw(st.integers(1, n))
        check(lambda: torch.sort(x, dim=dim, descending=flag_a, stable=flag_b))
        check(lambda: torch.topk(x, k, dim=dim, largest=flag_a, sorted=flag_b))
        check(lambda: torch.kthvalue(x, k, dim=dim, keepdim=flag_a))
        check(lambda: torch.median(x, dim=dim, keepdim=flag_b))
        check(lambda: torch.nanmedian(x, dim=dim))
        check(lambda: torch.median(x))
        check(lambda: torch.nanmedian(x))
        check(lambda: torch.mode(x, dim=dim))
        if x.dtype.is_floating_point:
            q = torch.tensor(data.draw(st.lists(st.floats(0, 1), min_size=1, max_size=4)),
                             dtype=x.dtype)
            interp = data.draw(st.sampled_from(["linear", "lower", "higher", "midpoint",
                                                "nearest"]))
            check(lambda: torch.quantile(x, q, dim=dim, keepdim=flag_a, interpolation=interp))
            check(lambda: torch.nanquantile(x, q, dim=None, interpolation=interp))
    finally:
        sorting.MIN_NUMEL, sorting.MIN_ROW = saved


def test_many_calls_do_not_grow_memory():
    x = torch.randn(4, 5000)  # above every op's size cut-off
    before = sum(rows.calls.values())
    with kto.accelerated():
        for _ in range(1000):  # warm up allocator and caches
            torch.topk(x, 5)
            torch.sort(x, stable=True)
        start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(20000):
            torch.topk(x, 5)
            torch.sort(x, stable=True)
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start
    assert sum(rows.calls.values()) - before == 42000  # every call ran a Kwker kernel
    assert grown_kib < 20 * 1024
