"""The eager runner's program marks the steps that call Kwker kernels (``step.kernels``)."""
import pytest
import torch

import kwker.dynamo as kd


def test_kernel_steps_carry_their_kernel_name():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(),
                                torch.nn.Linear(40, 8), torch.nn.Softmax(-1)).eval()
    graphs = []

    def keep(gm, example_inputs):  # the kwker backend, keeping what it hands dynamo
        graphs.append(kd.backend(gm, example_inputs, options={"inner": "eager"}))
        return graphs[-1]

    torch._dynamo.reset()
    x = torch.randn(3, 24)
    with torch.no_grad():
        torch.compile(model, backend=keep)(x)
    (graph,) = graphs
    steps = [s for s, _ in graph.plan.program.steps]
    tagged = [name for s in steps for name in getattr(s, "kernels", ())]
    assert tagged == graph.report.kernel_names and tagged  # in program order
    # both linears one chained step (lowering/chain.py); softmax on ATen, untagged
    assert [s.kernel for s in steps if hasattr(s, "kernel")] == ["chain(linear_gelu, linear)"]
    assert len(steps) == 2


class _Block(torch.nn.Module):
    """A decoder layer's kernels between two attentions: projection + residual, norm, MLP
    (+ residual), the next norm and q/k/v projection; ``mutate``: the input ``a`` written in
    place after the first kernel read it."""

    def __init__(self, d=32, mutate=False):
        super().__init__()
        self.proj, self.ln1 = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.ln2, self.qkv = torch.nn.LayerNorm(d), torch.nn.Linear(d, 3 * d)
        self.mutate = mutate

    def forward(self, a, x):
        x = x + self.proj(a)
        if self.mutate:
            a.mul_(2)
        h = self.ln1(x)
        x = x + self.out(torch.nn.functional.gelu(self.fc(h), approximate="tanh"))
        return self.qkv(self.ln2(x)), x


def _compiled(model, *args):
    """(outputs, program steps) of ``model`` compiled with kernels built for its sizes: no
    stand-ins, whose chains depend on what the cache holds (see the stand-in test)."""
    from kwker.lowering.build import specialising
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(kd.backend(gm, example_inputs, options={"inner": "eager"}))
        return graphs[-1]
    torch._dynamo.reset()
    with torch.no_grad(), specialising():
        out = torch.compile(model, backend=keep)(*args)
    (graph,) = graphs
    return out, [s for s, _ in graph.plan.program.steps]


def test_chained_steps_give_what_the_kernels_give_one_by_one(monkeypatch):
    """The layer's six kernels are one chained step, its residual stream (read outside) one of
    its values; bit for bit what the same kernels give as six steps."""
    torch.manual_seed(0)
    model = _Block().eval()
    args = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    out, steps = _compiled(model, *args)
    assert [getattr(s, "kernels", None) for s in steps] == [
        ["linear_residual", "layer_norm", "linear_gelu_tanh", "linear_residual", "layer_norm",
         "linear"]]
    import kwker.lowering.partition as partition
    monkeypatch.setattr(partition, "chain_kernels", lambda steps, nodes, metas: steps)
    plain, steps = _compiled(model, *args)
    assert len(steps) == 6
    assert all(torch.equal(a, b) for a, b in zip(out, plain))
    with torch.no_grad():
        want = model(*args)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(out, want))


def test_no_chain_across_a_write():
    """A kernel reading a tensor written in place after it keeps its own step: in a chain
    placed after the write, it would read the written values."""
    torch.manual_seed(0)
    model = _Block(mutate=True).eval()
    args = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    with torch.no_grad():
        want = model(*[a.clone() for a in args])
    out, steps = _compiled(model, *[a.clone() for a in args])
    kernels = [s.kernels for s in steps if hasattr(s, "kernels")]
    assert kernels[0] == ["linear_residual"] and len(kernels[1]) == 5, kernels
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(out, want))


class _LlamaBlock(torch.nn.Module):
    """A Llama layer's kernels between two attentions, written as transformers writes them:
    each RMSNorm starts with an identity ``to(float32)``, and the q projection is viewed to
    heads before k and v are projected."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.o, self.gate, self.up, self.down = lin(d, d), lin(d, 3 * d), lin(d, 3 * d), \
            lin(3 * d, d)
        self.q, self.k, self.v = lin(d, d), lin(d, d // 2), lin(d, d // 2)
        self.w1, self.w2 = (torch.nn.Parameter(torch.rand(d) + 0.5) for _ in range(2))
        self.heads = heads

    @staticmethod
    def rms(x, w):
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * x.to(torch.float32)

    def forward(self, a, x):
        x = x + self.o(a)
        h = self.rms(x, self.w1)
        x = x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))
        h = self.rms(x, self.w2)
        q = self.q(h).view(1, 1, -1, 8).transpose(1, 2)
        k = self.k(h).view(1, 1, -1, 8).transpose(1, 2)
        v = self.v(h).view(1, 1, -1, 8).transpose(1, 2)
        return q, k, v, x


def test_llama_layer_is_one_chained_step(monkeypatch):
    """Through the norms' identity ``to`` and past q's views to heads (moved after the chain):
    the layer's ten kernels in one step, bit for bit what they give one by one."""
    torch.manual_seed(0)
    model = _LlamaBlock().eval()
    args = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    out, steps = _compiled(model, *args)
    chained = [s.kernels for s in steps if hasattr(s, "kernels")]
    assert chained == [["linear_residual", "rms_norm", "linear", "linear", "silu_mul",
                        "linear_residual", "rms_norm", "linear", "linear", "linear"]], chained
    import kwker.lowering.partition as partition
    monkeypatch.setattr(partition, "chain_kernels", lambda steps, nodes, metas: steps)
    plain, _ = _compiled(model, *args)
    assert all(a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
               for a, b in zip(out, plain))
    with torch.no_grad():
        want = model(*args)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(out, want))


class _Tail(torch.nn.Module):
    """GPT-2's last steps: the residual, the final norm, a view of it keeping its shape, the
    head."""

    def __init__(self, d=32, vocab=56):
        super().__init__()
        self.proj, self.ln = torch.nn.Linear(d, d), torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, a, x):
        x = x + self.proj(a)
        return self.head(self.ln(x).view(1, 1, -1))


def test_a_view_keeping_the_layout_does_not_end_a_chain(monkeypatch):
    torch.manual_seed(0)
    model = _Tail().eval()
    args = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    out, steps = _compiled(model, *args)
    assert [getattr(s, "kernels", None) for s in steps] == [
        ["linear_residual", "layer_norm", "linear"]]
    import kwker.lowering.partition as partition
    monkeypatch.setattr(partition, "chain_kernels", lambda steps, nodes, metas: steps)
    plain, steps = _compiled(model, *args)
    assert len(steps) == 3 and torch.equal(out, plain)   # the view takes no step either


def test_a_stand_ins_chain_is_not_compiled_on_the_call(monkeypatch):
    """Kernels standing in for a size they were not built for (build.py's no-stall rule) are
    chained only where the chain is built already: the call never waits on its compile."""
    import kwker.lowering.build as build
    from kwker.runtime import kernel
    real = build._build_without_stall

    def stand_in(m, metas, consts):
        fn, why = real(m, metas, consts)
        if fn is not None:
            fn.kwker_stand_in = True
        return fn, why
    monkeypatch.setattr(build, "_build_without_stall", stand_in)
    monkeypatch.setattr(kernel, "_kernels", {})      # nothing built in this process
    monkeypatch.setattr(kernel, "object_for", _refuse_chains(kernel.object_for))
    torch.manual_seed(0)
    model = _Block().eval()
    args = (torch.randn(1, 1, 32), torch.randn(1, 1, 32))
    out, steps = _compiled(model, *args)
    assert [s.kernels for s in steps if hasattr(s, "kernels")] == [
        ["linear_residual"], ["layer_norm"], ["linear_gelu_tanh"], ["linear_residual"],
        ["layer_norm"], ["linear"]]
    with torch.no_grad():
        want = model(*args)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(out, want))


def _refuse_chains(object_for):
    """``object_for`` as if no chain were in the cache: compiling one raises NotCompiled where
    compiles are not allowed."""
    from kwker.runtime import kernel

    def get(spec, target):
        if spec.family == "chain" and not getattr(kernel._policy, "allowed", True):
            raise kernel.NotCompiled(spec.symbol)
        return object_for(spec, target)
    return get


def _deferring_graph(read_elsewhere: bool):
    """A graph whose kernel step gives ``x + 1`` and, deferred, ``x``'s first row as a view;
    ``read_elsewhere``: that view also read by another node before the output."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(torch.add, (x, 1))
    row = graph.call_function(torch.narrow, (x, 0, 0, 1))
    row_read = graph.call_function(torch.mul, (row, 2)) if read_elsewhere else row
    graph.output((out, row_read))
    return torch.fx.GraphModule(torch.nn.Module(), graph), x, out, row


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_deferred_views_are_made_with_the_output_only_where_it_alone_reads_them(
        read_elsewhere):
    """A kernel step's ``deferred`` extra values come as ``(base, size, stride)`` and leave the
    program as views (made when its output is built); a deferred value another node reads is
    refused when the program is built."""
    from kwker.lowering.runner import KernelStep, build_program
    gm, x, out, row = _deferring_graph(read_elsewhere)

    def kernel(t):
        return t + 1, (t, (1, t.shape[1]), t.stride())
    step = KernelStep(kernel, [x], out, [out, row], "k", [row], deferred=True)
    if read_elsewhere:
        with pytest.raises(ValueError, match="defers"):
            build_program(gm, [step])
        return
    t = torch.randn(3, 4)
    got_out, got_row = build_program(gm, [step])([t])
    assert torch.equal(got_out, t + 1) and isinstance(got_row, torch.Tensor)
    assert torch.equal(got_row, t[:1]) and got_row.data_ptr() == t.data_ptr()


def _kept_graph(change_in_place: bool):
    """x -> sizes -> arange -> products (constants and sizes alone), then a view of the last
    product changed in place (``change_in_place``) or given out, and a sum with x."""
    aten = torch.ops.aten
    g = torch.fx.Graph()
    x = g.placeholder("x")
    rows = g.call_function(aten.sym_size.int, (x, 0))
    ar = g.call_function(aten.arange.start, (0, rows))
    twice = g.call_function(aten.mul.Tensor, (ar, 2))
    thrice = g.call_function(aten.mul.Tensor, (twice, 3))
    view = g.call_function(aten.view.default, (thrice, [-1]))
    outs = [g.call_function(aten.add.Tensor, (thrice, x))]
    if change_in_place:
        g.call_function(aten.add_.Tensor, (view, 1))
    else:
        outs.append(view)
    g.output(tuple(outs))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("change_in_place", [True, False])
def test_results_kept_per_size_are_never_changed_in_place_or_given_out(change_in_place):
    """A region of steps computed from sizes alone keeps its results per size (lowering/memo.py)
    only where no step changes them in place through a view and the graph does not give out a
    view of them: each call then gives what the graph computes, however often the size
    repeats (and a caller changing what it was given changes nothing kept)."""
    from kwker.lowering.runner import build_program
    from kwker.lowering.shapes import propagate
    gm = _kept_graph(change_in_place)
    x = torch.ones(5, dtype=torch.int64)
    program = build_program(gm, [], propagate(gm, [x]))
    assert any(hasattr(step, "memo") for step, _ in program.steps)   # ``arange``, ``* 2`` kept
    for _ in range(3):
        got, want = program([x]), gm(x)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        if not change_in_place:
            got[1].add_(100)


def test_results_kept_per_size_stay_out_of_autograd_and_inference_mode():
    """Results kept per size are made afresh where they would carry an autograd graph (a constant
    that requires grad: each call's backward runs through its own), and those made under
    ``torch.inference_mode`` are not given to a call outside it (autograd may not save them)."""
    from kwker.lowering.runner import build_program
    from kwker.lowering.shapes import propagate
    aten = torch.ops.aten
    root = torch.nn.Module()
    root.w = torch.nn.Parameter(torch.tensor(0.5))
    root.c = torch.tensor(3.0)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    rows = g.call_function(aten.sym_size.int, (x, 0))
    ar = g.call_function(aten.arange.start, (0, rows), {"dtype": torch.float32})
    scaled = g.call_function(aten.mul.Tensor, (ar, g.get_attr("c")))
    plain = g.call_function(aten.mul.Tensor, (scaled, 2))         # kept: constants, sizes
    graded = g.call_function(aten.mul.Tensor, (plain, g.get_attr("w")))   # requires grad
    g.output((g.call_function(aten.mul.Tensor, (graded, x)),
              g.call_function(aten.mul.Tensor, (plain, x))))
    gm = torch.fx.GraphModule(root, g)
    x = torch.randn(4)
    with torch.no_grad():
        program = build_program(gm, [], propagate(gm, [x]))
    assert any(hasattr(step, "memo") for step, _ in program.steps)
    with torch.inference_mode():
        program([x])
    xg = x.clone().requires_grad_()
    for _ in range(2):   # the second backward needs a graph of its own
        out, other = program([xg])
        (out.sum() + other.sum()).backward()
    want = 2 * (2 * torch.arange(4.0) * 3.0 * x).sum()
    torch.testing.assert_close(root.w.grad, want)
    torch.testing.assert_close(xg.grad, 2 * (torch.arange(4.0) * 6.0 * 0.5 +
                                             torch.arange(4.0) * 6.0))
