"""make_grouped_linear (a mixture of experts' grouped matmul) against ATen's torch._grouped_mm
(its matmul run by run where _grouped_mm refuses the layout): odd sizes, empty runs, rows routed
nowhere, bf16, bad offsets."""
import pytest
import torch

from kwker.kernels.grouped import make_grouped_linear

BF16 = torch.bfloat16


def aten(x, w, offs):
    """ATen's grouped matmul where it takes the layout (strides of whole 16 bytes), else its
    matmul run by run (what transformers' fallback does); rows past the runs are zeros."""
    ends = offs.tolist()
    if all(s * x.element_size() % 16 == 0 for s in (*x.stride()[:-1], *w.stride()[:-1])):
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        out[ends[-1]:] = 0
        return out
    out, start = x.new_zeros(x.shape[0], w.shape[1]), 0
    for g, end in enumerate(ends):
        out[start:end] = x[start:end] @ w[g].t()
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("counts,k,n", [
    ([5, 0, 17, 1, 9], 37, 29),          # an empty run, odd K and N
    ([64, 64, 64], 256, 96),
    ([1, 2, 3, 4, 5, 6, 7, 8], 48, 200),
    ([0, 0, 30], 16, 16)])
def test_grouped_linear_matches_aten(dtype, counts, k, n, threads):
    torch.manual_seed(len(counts) * k + n)
    experts, rows = len(counts), sum(counts) + 3   # 3 rows routed nowhere
    w = (torch.randn(experts, n, k) / k ** 0.5).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = make_grouped_linear(w)(x, offs)
    used = int(offs[-1])
    assert got.shape == (rows, n) and got.dtype == dtype
    expected = aten(x, w, offs)[:used]   # (ATen leaves the rest unspecified)
    if dtype == BF16:   # float32 sums rounded once: within a rounding of ATen's
        torch.testing.assert_close(got[:used].float(), expected.float(), rtol=2 ** -7,
                                   atol=2 ** -7)
    else:
        torch.testing.assert_close(got[:used], expected, rtol=1e-4, atol=1e-5)
    assert not got[used:].any()     # transformers' fallback zeroes the rows past the runs


def test_int64_offsets_and_every_call_its_own_routing():
    torch.manual_seed(1)
    w, x = torch.randn(4, 24, 40), torch.randn(20, 40)
    f = make_grouped_linear(w)
    for counts in ([5, 5, 5, 5], [20, 0, 0, 0], [0, 1, 0, 19]):
        offs = torch.tensor(counts).cumsum(0)
        torch.testing.assert_close(f(x, offs), aten(x, w, offs.to(torch.int32)),
                                   rtol=1e-4, atol=1e-5)


def test_bad_input():
    f = make_grouped_linear(torch.randn(3, 8, 16))
    x = torch.randn(10, 16)
    with pytest.raises(RuntimeError, match="must rise"):
        f(x, torch.tensor([4, 2, 10]))
    with pytest.raises(RuntimeError, match="must rise"):
        f(x, torch.tensor([4, 8, 11]))
    with pytest.raises(ValueError, match=r"offs must be \(3,\)"):
        f(x, torch.tensor([4, 10]))
    with pytest.raises(ValueError, match=r"x must be \(rows, 16\)"):
        f(torch.randn(10, 15), torch.tensor([4, 8, 10]))
    with pytest.raises(ValueError, match="experts, N, K"):
        make_grouped_linear(torch.randn(8, 16))


def test_builds_from_one_parameter_share_each_experts_packed_weights():
    """Two builds from one 3-D parameter (another graph, another size) read one packed copy
    per expert, and the experts' copies are distinct (each its own slice of the parameter)."""
    torch.manual_seed(2)
    w = torch.nn.Parameter(torch.randn(4, 24, 40), requires_grad=False)
    first = make_grouped_linear(w.detach(), source=w)
    again = make_grouped_linear(w.detach(), source=w)
    packed = [lin.packed_weight.data_ptr() for lin in first.linears]
    assert packed == [lin.packed_weight.data_ptr() for lin in again.linears]
    assert len(set(packed)) == 4
    x, offs = torch.randn(12, 40), torch.tensor([3, 6, 9, 12])
    torch.testing.assert_close(again(x, offs), aten(x, w.detach(), offs.to(torch.int32)),
                               rtol=1e-4, atol=1e-5)
