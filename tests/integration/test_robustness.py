"""What must never give a wrong answer or crash: dynamic shapes, graph breaks, other dtypes,
training, inference mode, buffers and non-tensor outputs, parameters changing after compile,
in-place ops, and ops Kwker has no kernel for."""
import pytest
import torch
import torch.nn.functional as F

import kwker.dynamo as kd
from kwker.runtime.kernel import stats as kernel_stats

from .models import assert_close, compile_run, kernels


class Small(torch.nn.Module):
    """Two linears, a buffer, and outputs that are not tensors."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 32)
        self.l2 = torch.nn.Linear(32, 8)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        h = F.gelu(self.l1(x))
        return self.l2(h) * self.scale, h.shape[0], "tag", None


class Scorer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(16, 32)
        self.items = torch.nn.Parameter(torch.randn(300, 32))

    def forward(self, x):
        return torch.topk(torch.relu(self.q(x)) @ self.items.t(), 5, dim=-1)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_new_batch_sizes_compile_nothing(inner, tmp_path, monkeypatch):
    """The second size makes dynamo pass symbolic sizes: one graph with generic kernels serves
    every later size with no LLVM compile (no kernel object even loaded). Size 1, which dynamo
    specialises by itself, gets a graph of its own that reuses the generic kernels."""
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path))  # nothing found on disk by luck
    torch.manual_seed(0)
    model = Scorer().eval()
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    loads = []
    with torch.no_grad():
        for b in (32, 16, 8, 16, 32, 8, 5, 1, 97, 3):
            x = torch.randn(b, 16)
            v, i = compiled(x)
            rv, ri = model(x)
            torch.testing.assert_close(v, rv, rtol=1e-4, atol=1e-5)
            assert (i == ri).float().mean() >= 0.99
            loads.append(kernel_stats["hits"] + kernel_stats["misses"])
    assert len(set(loads[1:])) == 1, loads  # nothing compiled or loaded after the second size
    first, generic, size_one = kd.all_reports()
    assert first.kernel_sizes == ["specialised"] * len(first.kernels)
    for report in (generic, size_one):
        assert report.kernel_names == ["linear_relu", "linear_topk"]
        assert report.kernel_sizes == ["generic", "generic"]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("how", ["mark_dynamic", "dynamic=True"])
def test_symbolic_sizes_from_the_start(how, inner):
    torch.manual_seed(1)
    model = Small().eval()
    torch._dynamo.reset()
    kd.clear_reports()
    x = torch.randn(6, 16)
    if how == "mark_dynamic":
        torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(model, backend="kwker", options={"inner": inner},
                             dynamic=True if how == "dynamic=True" else None)
    with torch.no_grad():
        for xx in (x, torch.randn(9, 16), torch.randn(6, 16), torch.randn(2, 16)):
            assert_close(compiled(xx), model(xx))
    (report,) = kd.all_reports()
    assert report.kernel_names == ["linear_gelu", "linear"]
    assert report.kernel_sizes == ["generic", "generic"]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_training_gradients_match_eager(inner):
    torch.manual_seed(2)
    model = Small()
    x = torch.randn(4, 16, requires_grad=True)
    ref, out, reports = compile_run(model, (x,), inner, grad=True)
    assert_close(out, ref)
    out[0].square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    model(x)[0].square().sum().backward()
    expected = [p.grad for p in model.parameters()] + [x.grad]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert [r.status for r in reports] == ["training"]


def test_inference_mode_buffers_and_non_tensor_outputs():
    torch.manual_seed(3)
    model = Small().eval()
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    with torch.inference_mode():
        x = torch.randn(4, 16)
        out, ref = compiled(x), model(x)
    assert_close(out, ref)
    assert out[1:] == (4, "tag", None)
    assert kd.last_report().kernel_names == ["linear_gelu", "linear"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_other_dtypes_run_on_the_inner_compiler(dtype):
    torch.manual_seed(4)
    model = Small().to(dtype).eval()
    ref, out, reports = compile_run(model, (torch.randn(4, 16, dtype=dtype),), "eager")
    assert_close(out, ref)
    assert kernels(reports) == []
    assert reports[-1].missed and all(str(dtype) in why for _, _, why in reports[-1].missed)


def test_graph_break_both_graphs_lowered():
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l1 = torch.nn.Linear(16, 32)
            self.l2 = torch.nn.Linear(32, 40)

        def forward(self, x):
            h = torch.relu(self.l1(x))
            torch._dynamo.graph_break()
            return self.l2(h).sort(dim=-1, descending=True)

    torch.manual_seed(5)
    ref, out, reports = compile_run(Broken().eval(), (torch.randn(5, 16),), "eager")
    assert_close(out.values, ref.values)
    assert kernels(reports) == ["linear", "linear_relu", "sort"]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_parameters_changed_after_compile(inner):
    """Packed weights are constants, but an update or another module's weights is noticed."""
    torch.manual_seed(6)
    model = Small().eval()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert_close(compiled(x), model(x))
        model.l1.weight.mul_(2)                      # in place, as an optimiser step would
        assert_close(compiled(x), model(x))
        model.load_state_dict(Small().state_dict())  # copy_ into the same tensors
        assert_close(compiled(x), model(x))
        other = Small().eval()                       # same code, other parameters
        assert_close(torch.compile(other, backend="kwker", options={"inner": inner})(x),
                     other(x))


def test_in_place_ops_keep_program_order():
    class Mutating(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            x.add_(1)  # a kernel fused past this point would read the new x
            return torch.relu(y) + x, self.lin(x)

    torch.manual_seed(7)
    model = Mutating().eval()
    x = torch.randn(3, 8)
    x_eager = x.clone()
    torch._dynamo.reset()
    kd.clear_reports()
    with torch.no_grad():
        out = torch.compile(model, backend="kwker", options={"inner": "eager"})(x)
        ref = model(x_eager)
    assert_close(out, ref)
    assert torch.equal(x, x_eager)
    assert kernels(kd.all_reports()) == ["linear", "linear"]


def test_unsupported_ops_and_shapes_fall_back():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x, v, w):
            a = self.lin(x).cumsum(0)
            b = torch.matmul(v, v)             # 1-D @ 1-D: not a kernel shape
            c = torch.matmul(x[None], w)       # broadcast batch: ATen
            return a, b, c, x.to(torch.float64) @ x.to(torch.float64).t()

    torch.manual_seed(8)
    args = (torch.randn(5, 6), torch.randn(6), torch.randn(3, 6, 4))
    ref, out, reports = compile_run(Odd().eval(), args, "eager")
    assert_close(out, ref)
    assert kernels(reports) == ["linear"]


@pytest.mark.parametrize("where", ["around", "inside"])
def test_autocast_float16_keeps_the_inner_compiler(where):
    """Only bf16 autocast is lowered: a float16 region goes to the inner compiler, with why."""
    class Inside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.float16):
                y = F.gelu(self.lin(x))
            return y.float() + 1

    torch.manual_seed(9)
    model = Inside().eval() if where == "inside" else \
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).eval()
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    x = torch.randn(2, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16, enabled=where == "around"):
        out, ref = compiled(x), model(x)
    assert out.dtype == ref.dtype
    torch.testing.assert_close(out, ref)
    report = kd.last_report()
    assert report.status == "autocast" and "float16" in report.reason, str(report)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_lowering_bug_costs_speed_not_the_answer(inner, monkeypatch):
    from kwker.lowering import patterns

    def broken(self):
        raise RuntimeError("simulated matcher bug")

    monkeypatch.setattr(patterns.Matcher, "run", broken)
    torch.manual_seed(10)
    ref, out, reports = compile_run(Small().eval(), (torch.randn(4, 16),), inner)
    assert_close(out, ref)
    assert reports[-1].status == "fallback" and "simulated" in reports[-1].reason


def test_two_modules_sharing_a_graph_keep_their_own_weights():
    """Dynamo reuses one graph for two instances of a class; each keeps its packed weights."""
    torch.manual_seed(11)
    a, b = Small().eval(), Small().eval()
    torch._dynamo.reset()
    kd.clear_reports()
    ca = torch.compile(a, backend="kwker", options={"inner": "eager"})
    cb = torch.compile(b, backend="kwker", options={"inner": "eager"})
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(3):
            assert_close(ca(x), a(x))
            assert_close(cb(x), b(x))
    reports = kd.all_reports()
    assert len({r.graph for r in reports}) == 1  # one graph ...
    assert len(reports) == 2                     # ... specialised once per module, not per call
