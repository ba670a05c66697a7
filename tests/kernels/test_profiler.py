"""Kernel calls carry their spec's symbol as a torch.profiler range, only while profiling."""
import torch

from kwker.kernels.linear import make_linear
from kwker.kernels.sdpa import make_sdpa


def test_profiler_shows_kernel_names():
    f = make_linear(torch.randn(8, 4), torch.randn(8), 3, "relu")
    g = make_sdpa(1, 1, 4, 4, 8, 8)
    x, q = torch.randn(3, 4), torch.randn(1, 1, 4, 8)
    f(x)  # not profiling: no range, nothing recorded
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        f(x)
        g(q, q, q)
    names = {e.name for e in prof.events()}
    assert f.spec.symbol in names and g.spec.symbol in names
