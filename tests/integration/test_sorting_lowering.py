"""Sorting-type ops in a compiled graph run the drop-in's kernels and stay bit-identical."""
import pytest
import torch

import kwker.dynamo as kd
from kwker.ops import rows


class Sorting(torch.nn.Module):
    def forward(self, x, q):
        return (torch.topk(x, 5), torch.sort(x, dim=0, descending=True), torch.sort(x, stable=True),
                x.argsort(dim=1, descending=True), torch.msort(x), torch.kthvalue(x, 3, 1),
                torch.mode(x.round(), 1), torch.median(x), torch.median(x, 1, keepdim=True),
                torch.nanmedian(x, 0), x.nanmedian(), torch.quantile(x, 0.3, dim=1),
                torch.quantile(x, q, dim=0, keepdim=True),
                torch.nanquantile(x, 0.7, interpolation="nearest"))


def _flat(result):
    return [t for r in result for t in (r if isinstance(r, tuple) else (r,))]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_sorting_ops_lowered_bit_identical(inner):
    torch.manual_seed(0)
    x = torch.randn(512, 1024)  # rows along both dims above every op's size cut-off
    x[3, 7] = float("nan")
    x[5, :9] = 0.25  # ties
    q = torch.tensor([0.1, 0.5, 0.9])
    torch._dynamo.reset()
    kd.clear_reports()
    before = sum(rows.calls.values())
    with torch.no_grad():
        out = torch.compile(Sorting(), backend="kwker", options={"inner": inner})(x, q)
    ran = sum(rows.calls.values()) - before
    expected = Sorting()(x, q)
    for got, want in zip(_flat(out), _flat(expected), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.stride() == want.stride()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    report = kd.last_report()
    assert len(report.kernels) == 14 and not report.missed, str(report)
    assert ran >= 14  # every op took a Kwker row kernel (none handed back to ATen)
