"""Adversarial inputs for parity tests: ties, NaN, signed zeros, infinities, subnormals, runs."""
from __future__ import annotations

import torch

FLOATS = (torch.float32, torch.float64)
HALFS = (torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
DTYPES = FLOATS + HALFS + INTS

FLOAT_PATTERNS = ("normal", "ties4", "ties2", "ties_nan", "signed_zero", "specials", "ascending",
                  "descending", "equal", "subnormal", "asc_ties", "few_dups", "tie_runs")
INT_PATTERNS = ("normal", "ties4", "ties2", "ascending", "descending", "equal", "asc_ties",
                "few_dups", "tie_runs")


def patterns(dtype: torch.dtype):
    return FLOAT_PATTERNS if dtype.is_floating_point else INT_PATTERNS


def make(pattern: str, shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if pattern == "normal":
        if dtype.is_floating_point:
            x = torch.randn(n, generator=g, dtype=torch.float64)
        else:
            lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
            x = torch.randint(lo, hi, (n,), generator=g)
    elif pattern == "few_dups":  # mostly distinct, 2% copies: ties in a few small ranges only
        x = torch.randperm(n, generator=g).double() - n // 2
        copies = torch.randint(0, n, (max(1, n // 50), 2), generator=g)
        x[copies[:, 0]] = x[copies[:, 1]]
    elif pattern == "tie_runs":  # each value ~100 times: all-equal ranges of 64+ mid-recursion
        x = torch.randint(0, max(1, n // 100), (n,), generator=g)
    elif pattern == "ties4":
        x = torch.randint(0, 4, (n,), generator=g)
    elif pattern == "ties2":
        x = torch.randint(0, 2, (n,), generator=g)
    elif pattern == "ties_nan":
        x = torch.randint(0, 4, (n,), generator=g).double()
        x[torch.rand(n, generator=g) < 0.15] = float("nan")
    elif pattern == "signed_zero":
        x = torch.randint(-1, 2, (n,), generator=g).double()
        zero = x == 0
        x[zero & (torch.rand(n, generator=g) < 0.5)] = -0.0
    elif pattern == "specials":
        vals = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 1.0, float("nan")],
                            dtype=torch.float64)
        x = vals[torch.randint(0, 6, (n,), generator=g)]
    elif pattern == "ascending":
        x = torch.arange(n)
    elif pattern == "descending":
        x = torch.arange(n, 0, -1)
    elif pattern == "equal":
        x = torch.full((n,), 3)
    elif pattern == "asc_ties":
        x = torch.arange(n) // 3
    elif pattern == "subnormal":
        tiny = torch.finfo(dtype).tiny
        x = torch.randint(-3, 4, (n,), generator=g).double() * tiny / 8
    else:
        raise ValueError(pattern)
    return x.to(dtype).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns of a tensor, so NaN payloads and signed zeros compare exactly."""
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    if t.dtype in HALFS:
        return t.view(torch.int16)
    return t


def assert_identical(got, want, what: str = "") -> None:
    if isinstance(want, torch.Tensor):
        got, want = (got,), (want,)
    assert len(got) == len(want), what
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, f"{what}: dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if g.numel() > 1:
            assert g.stride() == w.stride(), f"{what}: strides {g.stride()} != {w.stride()}"
        gb, wb = bits(g.contiguous()), bits(w.contiguous())
        if not torch.equal(gb, wb):
            bad = (gb != wb).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {int((gb != wb).sum())} mismatches, first at {bad}")
