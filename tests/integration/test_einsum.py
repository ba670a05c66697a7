"""``torch.einsum`` that is a matrix product becomes ``matmul`` (decompose.py), so einsum-written
projections and attention get the kernels ``@`` gets; other einsums stay as they are."""
import pytest
import torch
import torch.nn.functional as F

from kwker.lowering.decompose import _einsum_plan

from .models import assert_close, compile_run, kernels


@pytest.mark.parametrize("eq,shapes", [
    ("ij,jk->ik", [(5, 7), (7, 3)]),
    ("ki,kj->ij", [(7, 5), (7, 3)]),
    ("bij,bjk->bik", [(2, 5, 7), (2, 7, 3)]),
    ("bid,jd->bij", [(2, 5, 7), (3, 7)]),
    ("ij,bjk->bik", [(5, 7), (2, 7, 3)]),
    ("bhid,hjd->bhij", [(2, 3, 5, 4), (3, 6, 4)]),
    ("...id,...jd->...ij", [(2, 3, 5, 4), (2, 3, 6, 4)]),
    ("b h i d, b h j d -> b h i j", [(2, 3, 5, 4), (2, 3, 6, 4)]),
])
def test_matmul_einsums_agree_with_einsum(eq, shapes):
    torch.manual_seed(len(eq))
    a, b = (torch.randn(s) for s in shapes)
    ta, tb = _einsum_plan(eq)
    got = (a.transpose(-2, -1) if ta else a) @ (b.transpose(-2, -1) if tb else b)
    torch.testing.assert_close(got, torch.einsum(eq, a, b))


@pytest.mark.parametrize("eq", ["bij,bjk->bki", "ii,ij->j", "bi,bi->b", "bij,bjk->ik",
                                "bhid,bjd->bhij", "ij,jk,kl->il", "iij,jk->ik"])
def test_other_einsums_are_not_matmuls(eq):
    assert _einsum_plan(eq) is None


class EinsumAttention(torch.nn.Module):
    def __init__(self, d=64, h=4, diagonal=True):
        super().__init__()
        self.diagonal = diagonal
        self.h, self.qkv, self.o = h, torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d)
        self.w = torch.nn.Parameter(torch.randn(d, 2 * d) / d ** 0.5)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        sim = torch.einsum("bhid,bhjd->bhij", q, k) * (q.shape[-1] ** -0.5)
        y = torch.einsum("bhij,bhjd->bhid", sim.softmax(dim=-1), v)
        y = self.o(y.permute(0, 2, 1, 3).reshape(b, n, d))
        out = F.gelu(torch.einsum("bld,dh->blh", y, self.w))
        return (out, torch.einsum("bhii->bhi", sim)) if self.diagonal else out


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_einsum_model_gets_attention_and_linear_kernels(inner):
    torch.manual_seed(2)
    model = EinsumAttention().eval()
    x = torch.randn(2, 24, 64)
    expected, got, reports = compile_run(model, (x,), inner)
    names = kernels(reports)
    assert "linear_gelu" in names and "sdpa" not in names, names   # sim is read twice
    assert_close(got, expected)


def test_einsum_attention_is_attention():
    torch.manual_seed(3)
    model = EinsumAttention(diagonal=False).eval()
    x = torch.randn(2, 24, 64)
    expected, got, reports = compile_run(model, (x,), "eager")
    assert "sdpa" in kernels(reports), "\n".join(map(str, reports))
    assert_close(got, expected)
