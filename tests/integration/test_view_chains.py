"""The eager runner makes each chain of view ops one ``as_strided`` call (lowering/views.py): the
same values, strides and aliasing as the ops written out, and the ops themselves where the
start tensor's layout is not the one recorded."""
import torch
import torch.nn.functional as F

import kwker.dynamo as kd
from kwker.lowering import views
from kwker.lowering.runner import build_program
from kwker.lowering.shapes import propagate


class Heads(torch.nn.Module):
    """A fused q/k/v projection split into heads, as a decoder's attention block does."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(32, 48)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split(16, dim=2)
        q = q.view(b, t, 2, 8).transpose(1, 2)
        k = k.view(b, t, 2, 8).transpose(1, 2)
        v = v.view(b, t, 2, 8).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v)
        flat = o.transpose(1, 2).contiguous().reshape(b, t, 16)
        copied = k.transpose(2, 3).reshape(b, -1)  # a reshape that copies: not a view
        return flat, k, copied, v[:, 1:, ::2]


def compiled_graphs(model, x):
    graphs = []

    def keep(gm, example_inputs):  # the kwker backend, keeping what it hands dynamo
        graphs.append(kd.backend(gm, example_inputs, options={"inner": "eager"}))
        return graphs[-1]

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=keep)(x)
    return got, graphs


def test_view_chains_give_what_the_ops_give():
    torch.manual_seed(0)
    model, x = Heads().eval(), torch.randn(3, 5, 32)
    with torch.no_grad():
        expected = model(x)
    got, (graph,) = compiled_graphs(model, x)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        assert g.shape == e.shape and g.stride() == e.stride()
    assert got[1]._base is not None  # a view, as eager's k is
    steps = [s for s, _ in graph.plan.program.steps]
    strided = [s for s in steps if getattr(s, "strided", False)]
    # q, k and v to heads, the attention output to rows, v's slice and k's transpose that the
    # copying reshape reads (which runs as written); the split, its items and the inner views
    # need no step
    assert len(strided) == 6, len(strided)


def test_a_collapsed_view_aliases_its_root():
    """Writing through a view made by ``as_strided`` changes the tensor it views, as writing
    through the written-out view does."""
    def f(x):
        h = x * 1
        h.view(4, 6).t()[1:3].fill_(7.0)
        return h

    gm = torch.fx.symbolic_trace(f)
    x = torch.randn(24)
    metas = propagate(gm, [x])
    program = build_program(gm, [], metas)
    assert any(getattr(s, "strided", False) for s, _ in program.steps)
    got = program([x])
    assert torch.equal(got, f(x))


class Marked(torch.Tensor):
    """A tensor subclass, whose views keep the subclass."""


def test_another_layout_runs_the_ops():
    """A start tensor whose strides are not the recorded ones, or of a subclass, takes the ops
    as written."""
    def f(x):
        return x.view(2, 3, 4).transpose(0, 1)[1:]

    gm = torch.fx.symbolic_trace(f)
    nodes = list(gm.graph.nodes)
    x = torch.randn(24)
    made, skipped = views.collapse(nodes, propagate(gm, [x]), set(), set())
    (last,) = made
    assert last is nodes[-2] and len(skipped) == 2
    step = views.make_step(made[last], 0, 1)
    for given in (x, torch.randn(48)[::2], torch.randn(24, 2)[:, 1], x.as_subclass(Marked)):
        env = [given, None]
        step(env)
        want = f(given)
        assert torch.equal(env[1], want) and env[1].stride() == want.stride()
        assert type(env[1]) is type(want)
        assert env[1].untyped_storage().data_ptr() == given.untyped_storage().data_ptr()


def test_unused_size_arithmetic_takes_no_step():
    def f(x):
        x.numel()
        x.size(0) + 1
        return x + 1

    gm = torch.fx.symbolic_trace(f)
    program = build_program(gm)
    assert len(program.steps) == 1
    x = torch.randn(3)
    got = program([x])
    assert torch.equal(got, x + 1)


def test_a_chain_that_changes_nothing_gives_the_tensor_back():
    def f(x):
        return x.contiguous().view(6, 4)[:2].contiguous()

    def g(x):
        return x.contiguous()

    x = torch.randn(6, 4)
    for fn, same in ((f, False), (g, True)):
        gm = torch.fx.symbolic_trace(fn)
        program = build_program(gm, [], propagate(gm, [x]))
        assert any(getattr(s, "strided", False) for s, _ in program.steps)
        got = program([x])
        assert torch.equal(got, fn(x)) and (got is x) == same
