"""LayerNorm lowered to Kwker's kernel: every form users write it in, both inner compilers,
static and dynamic rows, and packages; what does not fit stays on ATen/Inductor with a reason."""
import pytest
import torch
import torch.nn.functional as F

import kwker
import kwker.dynamo as kd

from .models import assert_close, compile_run


class Norms(torch.nn.Module):
    """LayerNorm as a module (affine, no bias), F.layer_norm without parameters and with a
    custom eps, on a (B, L, D) activation after a linear."""

    def __init__(self, d=48):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.ln = torch.nn.LayerNorm(d, bias=False)
        self.ln2 = torch.nn.LayerNorm(d, eps=1e-3)

    def forward(self, x):
        h = self.ln(self.lin(x))
        return F.layer_norm(h * 3 + 1, (h.shape[-1],)), self.ln2(h)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_layer_norm_forms(inner):
    torch.manual_seed(0)
    model = Norms().eval()
    with torch.no_grad():
        ref, out, reports = compile_run(model, (torch.randn(3, 7, 48),), inner)
    assert_close(out, ref)
    assert sorted(reports[-1].kernel_names) == ["layer_norm"] * 3 + ["linear"]


def test_what_does_not_fit_stays_on_aten():
    """Normalised over two dims, or a strided input: ATen's, with a reason in the report."""
    torch.manual_seed(1)
    w = torch.randn(6, 8)

    class Misfits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(w)

        def forward(self, x):
            return F.layer_norm(x, (6, 8), self.w), F.layer_norm(x.transpose(1, 2), (6,))
    with torch.no_grad():
        ref, out, reports = compile_run(Misfits().eval(), (torch.randn(2, 6, 8),), "eager")
    assert_close(out, ref)
    assert reports[-1].kernel_names == []
    missed = {name: why for name, _, why in reports[-1].missed}
    assert any("non-contiguous" in why for why in missed.values()), missed


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_rows_vary_one_kernel(inner, tmp_path, monkeypatch):
    """Rows dynamo makes symbolic (automatic dynamic, from the second size): one generic
    kernel serves every later row count (1, primes, large)."""
    from kwker.runtime.kernel import stats
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path))
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(40, 384), torch.nn.LayerNorm(384)).eval()
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    loads = []
    with torch.no_grad():
        for rows in (5, 6, 1, 2, 13, 97, 1031):
            x = torch.randn(rows, 40)
            assert_close(compiled(x), model(x))
            loads.append(stats["hits"] + stats["misses"])
    assert len(set(loads[1:])) == 1, loads
    kernels = {(k[0], k[3]) for r in kd.all_reports() for k in r.kernels}
    assert ("layer_norm", "generic") in kernels, kd.all_reports()


def test_packaged_layer_norm(tmp_path):
    """torch.export records ``aten.layer_norm``: a package runs it as a Kwker kernel."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64)).eval()
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, (torch.randn(4, 32),), dynamic_shapes=({0: batch},))
    loaded = kwker.load_package(kwker.package(ep, tmp_path / "ln.kwk"))
    assert "layer_norm" in loaded.report.kernel_names
    with torch.no_grad():
        for b in (1, 7, 64):
            x = torch.randn(b, 32)
            assert_close(loaded(x), model(x))
