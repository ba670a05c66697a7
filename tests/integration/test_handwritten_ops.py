"""Ops model libraries write out by hand: GELU spelled in elementwise ops (transformers'
gelu_new, FastGELU, an erf form) becomes the GELU kernel or a GEMM epilogue, recognised by what
it computes (a look-alike with other constants stays on ATen); a dropout in eval is a no-op the
residual fusion looks through."""
import copy
import math

import pytest
import torch

import kwker.dynamo as kd

from .models import assert_bf16_contract, assert_close


class NewGELU(torch.nn.Module):     # transformers' NewGELUActivation (GPT-2)
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) *
                                           (x + 0.044715 * torch.pow(x, 3.0))))


class FastGELU(torch.nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


class ErfGELU(torch.nn.Module):
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class LookAlike(torch.nn.Module):   # not a GELU: another constant inside tanh
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(0.8 * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.up, self.act = torch.nn.Linear(64, 160), act
        self.down, self.drop = torch.nn.Linear(160, 64), torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.up(x)
        return self.drop(self.down(self.act(h))) + x, self.act(x * 2)


EXPECTED = {  # activation -> (kernels, standalone GELU on x * 2)
    NewGELU: ["gelu", "linear_gelu_tanh", "linear_residual"],
    FastGELU: ["gelu", "linear_gelu_tanh", "linear_residual"],
    ErfGELU: ["gelu", "linear_gelu", "linear_residual"],
    LookAlike: ["linear", "linear_residual"],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("act", sorted(EXPECTED, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_handwritten_gelu_and_dropout(act, dtype):
    torch.manual_seed(13)
    model = Block(act()).eval()
    x = torch.randn(7, 64)
    low = copy.deepcopy(model).to(dtype)
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(low, backend="kwker", options={"inner": "eager"})
    with torch.no_grad():
        got, eager = compiled(x.to(dtype)), low(x.to(dtype))
        reference = model(x)
    report = kd.last_report()
    assert sorted(report.kernel_names) == EXPECTED[act], str(report)
    assert any("drop" in n for k in report.kernels for n in k[1]), str(report)
    if dtype == torch.float32:
        assert_close(got, eager)
    else:
        assert_bf16_contract(got, eager, reference)


class Conv1D(torch.nn.Module):      # transformers' Conv1D (GPT-2): a linear written as rows
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) / nx ** 0.5)
        self.bias = torch.nn.Parameter(torch.randn(nf) / 10)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class Conv1DBlock(torch.nn.Module):  # GPT-2's MLP with its residual
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.proj = Conv1D(160, 64), NewGELU(), Conv1D(64, 160)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(x)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "autocast"],
                         ids=["f32", "bf16", "autocast"])
@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_rows_linear_fuses_its_epilogue_through_the_views(dtype, inner):
    """``addmm(b, x.view(-1, k), w).view(*x.shape[:-1], n)`` is the linear of the 3-D x: the
    GELU and the residual after the view fuse into it, as after nn.Linear. Under autocast the
    float32 view is cast to bf16 before the product (GPT-2's blocks): still one linear each,
    the GELU fused, and the float32 residual added in the kernel into a float32 result."""
    torch.manual_seed(14)
    model = Conv1DBlock().eval()
    x = torch.randn(3, 5, 64)
    autocast = dtype == "autocast"
    low = copy.deepcopy(model) if autocast else copy.deepcopy(model).to(dtype)
    xin = x if autocast else x.to(dtype)
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(low, backend="kwker", options={"inner": inner})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, eager = compiled(xin), low(xin)
    with torch.no_grad():
        reference = model(x)
    report = kd.last_report()
    assert sorted(report.kernel_names) == ["linear_gelu_tanh", "linear_residual"], str(report)
    assert got.shape == eager.shape and got.dtype == eager.dtype
    if dtype == torch.float32:
        assert_close(got, eager)
    else:
        assert_bf16_contract(got, eager, reference)


class SiLUBlock(torch.nn.Module):
    """A SiLU (nn.SiLU, in place too), sigmoid or tanh after a linear fuses into its epilogue;
    SwiGLU's gate ``silu(g(x)) * u(x)`` stays the silu_mul kernel."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(48, 96), torch.nn.Linear(96, 48)
        self.g, self.u = torch.nn.Linear(48, 80, bias=False), torch.nn.Linear(48, 80, bias=False)
        self.act = torch.nn.SiLU(inplace=True)
        self.c, self.d = torch.nn.Linear(80, 30), torch.nn.Linear(80, 30)

    def forward(self, x):
        h = self.b(self.act(self.a(x)))
        y = torch.nn.functional.silu(self.g(h)) * self.u(h)
        return torch.sigmoid(self.c(y)) * self.d(y).tanh()     # an LSTM-like gate


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_silu_epilogue_and_swiglu_gate(inner):
    torch.manual_seed(14)
    model = SiLUBlock().eval()
    x = torch.randn(9, 48)
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    with torch.no_grad():
        got, eager = compiled(x), model(x)
    names = sorted(n for r in kd.all_reports() for n in r.kernel_names)
    assert names == ["linear", "linear", "linear", "linear_sigmoid", "linear_silu",
                     "linear_tanh", "silu_mul"], names
    assert_close(got, eager)


class ChunkedSwiGLU(torch.nn.Module):
    """Phi-3's MLP: one gate-and-up projection, chunked; SiLU of one half times the other."""

    def __init__(self, d=48, f=88):
        super().__init__()
        self.gate_up, self.down = torch.nn.Linear(d, 2 * f, bias=False), torch.nn.Linear(f, d)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(up * torch.nn.functional.silu(gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("inner,dynamic", [("eager", False), ("eager", True),
                                           ("inductor", False)])
def test_chunked_swiglu_reads_the_halves_in_place(inner, dynamic, dtype):
    torch.manual_seed(15)
    model = ChunkedSwiGLU().eval().to(dtype)
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner}, dynamic=dynamic)
    with torch.no_grad():
        for rows in (3, 17):
            x = torch.randn(2, rows, 48).to(dtype)
            got, eager = compiled(x), model(x)
            if dtype == torch.float32:
                assert_close(got, eager)
            else:   # the same roundings as eager's two ops: at most the GEMMs' differences
                torch.testing.assert_close(got.float(), eager.float(), rtol=2e-2, atol=2e-2)
    names = {n for r in kd.all_reports() for n in r.kernel_names}
    assert "silu_mul" in names, [str(r) for r in kd.all_reports()]
