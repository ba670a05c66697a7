"""GEMM kernels generic over the row count (and the batch of a runtime B): one kernel, every size.

Against ATen (float32) or a float64 product of the bf16-rounded operands (bfloat16), at M = 1,
every row edge of the register tile, primes and sizes past the cache blocks, with 1 and 2
threads (the split by rows and by columns both run).
"""
import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.linear import make_linear
from kwker.kernels.matmul import make_matmul

ROWS = [*range(1, 30), 31, 37, 64, 97, 255, 257, 1031]
ACTS = {"none": lambda t: t, "relu": torch.relu, "silu": F.silu, "sigmoid": torch.sigmoid,
        "tanh": torch.tanh, "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


def _check(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref.float(), rtol=1e-4, atol=1e-4)
    else:  # one bf16 rounding of float32 sums: 2^-8 relative, plus the sums' own error
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-3 * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,epilogue,residual", [(96, 64, "gelu", False),
                                                   (100, 33, "relu", True),
                                                   (512, 300, "none", True),
                                                   (33, 1100, "gelu_tanh", False),
                                                   (70, 45, "silu", True),
                                                   (40, 30, "sigmoid", False),
                                                   (50, 20, "tanh", True)])
def test_linear_generic_over_rows(n, k, epilogue, residual, dtype):
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) / k ** 0.5, torch.randn(n)
    fn = make_linear(w, b, None, epilogue, residual, dtype=dtype)
    assert fn.spec.m == 0
    wr, br = w.to(dtype).double(), b.to(dtype).double()
    x_all, r_all = torch.randn(max(ROWS), k).to(dtype), torch.randn(max(ROWS), n).to(dtype)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in ROWS:
            x, r = x_all[:m], r_all[:m]
            ref = ACTS[epilogue](F.linear(x.double(), wr, br))
            if residual:
                ref = ref + r.double()
            _check(fn(x, r) if residual else fn(x), ref, dtype)
    torch.set_num_threads(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_matmul_generic_over_rows_and_batch(transposed, dtype):
    torch.manual_seed(7)
    k, n = 45, 70
    fn = make_matmul(None, k, n, batch=None, b_transposed=transposed, dtype=dtype)
    assert (fn.spec.m, fn.spec.batch) == (0, 0)
    for batch in (1, 2, 5):
        for m in (1, 5, 12, 13, 100):
            a = torch.randn(batch, m, k).to(dtype)
            b = torch.randn(batch, n, k).to(dtype) if transposed else \
                torch.randn(batch, k, n).to(dtype)
            ref = a.double() @ (b.double().mT if transposed else b.double())
            _check(fn(a, b), ref, dtype)


def test_empty_rows_and_bad_input():
    w = torch.randn(20, 8)
    fn = make_linear(w, None, None)
    assert fn(torch.randn(0, 8)).shape == (0, 20)
    with pytest.raises(ValueError, match="linear input"):
        fn(torch.randn(3, 9))
    with pytest.raises(NotImplementedError):
        fn(torch.randn(3, 8, dtype=torch.float64))
