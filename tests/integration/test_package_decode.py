"""A decoder's step packaged with its KV cache: ``kwker.package`` of a ``torch.export`` of one
decode step (the past a tuple of (key, value) pairs, its length dynamic) decodes with no dynamo,
taking the past as the model takes it, appending to it in place, its view chains one call each."""
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kwker

from .models import GPTDecoder

VOCAB = 512


def decoder():
    torch.manual_seed(0)
    return GPTDecoder(vocab=VOCAB, d=64, heads=4, layers=2).eval()


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    """(model, prompt, the loaded package of its decode step)."""
    model = decoder()
    prompt = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        logits, past = model(prompt, None)
    ids = logits.argmax(-1, keepdim=True)
    length = torch.export.Dim("length", min=2, max=200)
    ep = torch.export.export(model, (ids, past),
                             dynamic_shapes=({}, tuple(({2: length}, {2: length}) for _ in past)))
    path = kwker.package(ep, tmp_path_factory.mktemp("decode") / "step.kwk")
    return model, prompt, kwker.load_package(path)


def assert_step(logits, past, want_logits, want_past) -> None:
    """A step's logits and every layer's keys and values against the model's."""
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(past, want_past, rtol=1e-5, atol=1e-6)


def storages(past) -> list:
    return [t.untyped_storage().data_ptr() for kv in past for t in kv]


def test_greedy_steps_match_eager_and_append_in_place(packaged):
    model, prompt, step = packaged
    assert step.report.kernel_names.count("kv_append") == 4 and not step.report.missed
    with torch.no_grad():
        ref_logits, ref_past = model(prompt, None)
        past, seen = ref_past, None
        for i in range(12):
            ids = ref_logits.argmax(-1, keepdim=True)
            ref_logits, ref_past = model(ids, ref_past)
            logits, past = step(ids, past)
            assert_step(logits, past, ref_logits, ref_past)
            # from the second step on, the past is the buffer the step before returned a view
            # of (9 + 12 positions fit its first capacity): appended to, never copied
            if seen is not None:
                assert storages(past) == seen, i
            seen = storages(past)


def test_a_strided_past_from_elsewhere_gives_the_same_answer(packaged):
    """The past is taken at any strides (no contiguous copy): one the caller made, not a view of
    the package's buffers, is read as it is and copied into a new buffer by the append."""
    model, prompt, step = packaged
    with torch.no_grad():
        logits, past = model(prompt, None)
        strided = tuple(tuple(t.transpose(2, 3).contiguous().transpose(2, 3) for t in kv)
                        for kv in past)
        assert not strided[0][0].is_contiguous()
        ids = logits.argmax(-1, keepdim=True)
        want_logits, want_past = model(ids, past)
        got_logits, got_past = step(ids, strided)
    assert_step(got_logits, got_past, want_logits, want_past)


def test_inputs_structured_otherwise_are_refused_with_where(packaged):
    model, prompt, step = packaged
    with torch.no_grad():
        logits, past = model(prompt, None)
    ids = logits.argmax(-1, keepdim=True)
    with pytest.raises(TypeError, match=r"the inputs\[1\] must be a tuple or list of 2, got a "
                                        r"tuple of 1"):
        step(ids, past[:1])
    with pytest.raises(TypeError, match=r"the inputs must be a tuple or list of 2, got a tuple "
                                        r"of 5"):
        step(ids, *[t for kv in past for t in kv])
    with pytest.raises(TypeError, match=r"the inputs\[1\]\[0\]\[1\] must be a Tensor|"
                                        r"input 'past_0_1' must be a Tensor"):
        step(ids, ((past[0][0], None), past[1]))


def test_view_chains_of_an_exported_graph_are_one_call_each(packaged):
    """An exported graph spells its views as ATen overloads (``aten.view``, ``aten.transpose``,
    ``aten.split``): each chain between kernels is one ``as_strided`` step, as in a dynamo graph,
    and no view op is called one by one. q and the new keys and values, views of the q/k/v
    projection, are read in place by the step that appends to the caches and attends, which
    gives its output as the rows the output projection reads."""
    model, prompt, step = packaged
    steps = [s for s, _ in step._program.steps]
    # the last position's row alone
    assert sum(bool(getattr(s, "strided", False)) for s in steps) == 1
    assert [getattr(s, "kernel", "") for s in steps].count("sdpa_kv_append") == 2
    with torch.no_grad():
        logits, past = model(prompt, None)
        with Calls() as calls:
            step(logits.argmax(-1, keepdim=True), past)
    views = {"view", "transpose", "split", "reshape", "_unsafe_view", "select", "unsqueeze"}
    assert not views & calls.names, calls.names


class Calls(TorchDispatchMode):
    """The ATen ops called inside, by name (``aten.view.default`` -> ``view``), and how
    often."""

    def __init__(self):
        super().__init__()
        self.names, self.count = set(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class LoneQuery(torch.nn.Module):
    """One query over a past of dynamic length, masked as transformers masks it when exported:
    ``kv_idx <= q_idx`` with the query at the past's end (``shift`` 0: every key visible), or
    one position earlier (``shift`` 1: the last key masked)."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift

    def forward(self, q, k, v):
        past = k.shape[2] - 1
        keys = torch.arange(past + 1)[None, None, None, :]
        query = (torch.arange(1) + past - self.shift)[None, None, :, None]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                attn_mask=keys <= query)


@pytest.mark.parametrize("shift", [0, 1])
def test_a_lone_querys_causal_mask_runs_unmasked_only_when_it_masks_nothing(shift, tmp_path):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 4, 9, 16), torch.randn(1, 4, 9, 16)
    length = torch.export.Dim("length", min=2, max=100)
    ep = torch.export.export(LoneQuery(shift), (q, k, v),
                             dynamic_shapes=({}, {2: length}, {2: length}))
    step = kwker.load_package(kwker.package(ep, tmp_path / "lone.kwk"))
    (spec,) = [s for s in step.report.specs if s.family == "attention"]
    assert spec.mask == ("none" if shift == 0 else "bool"), spec
    for n in (9, 40):
        k, v = torch.randn(1, 4, n, 16), torch.randn(1, 4, n, 16)
        with Calls() as calls:
            got = step(q, k, v)
        torch.testing.assert_close(got, LoneQuery(shift)(q, k, v), rtol=1e-5, atol=1e-6)
        # a mask attention drops is not computed either
        assert bool({"arange", "le"} & calls.names) == (shift == 1), calls.names


def test_ops_giving_back_their_input_are_no_steps(tmp_path):
    """An exported graph's eval-mode dropout (``aten.dropout(x, p, False)``) and its ``to`` of
    the device and dtype a tensor already has give back their input: no step of the program
    calls them. A ``to`` that converts, or is asked to copy, still runs."""
    class Embedded(torch.nn.Module):   # GPT-2's: the embeddings' sum, then a dropout
        def __init__(self):
            super().__init__()
            self.drop, self.lin = torch.nn.Dropout(0.1), torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(self.drop(x + (x * 2).to(x.device)))
            return h, h.to(torch.float64), h.to(torch.float32, copy=True)
    model = Embedded().eval()
    x = torch.randn(3, 8)
    ep = torch.export.export(model, (x,))
    targets = {n.target for n in ep.graph.nodes}
    assert {torch.ops.aten.dropout.default, torch.ops.aten.to.dtype_layout} <= targets
    packaged = kwker.load_package(kwker.package(ep, tmp_path / "drop.kwk"))
    got = packaged(x)
    torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-5)
    # a ``to`` asked to copy (``copy`` passed positionally in the graph) copies
    assert got[2].data_ptr() != got[0].data_ptr()
    called = {c.cell_contents for s, _ in packaged._program.steps for c in s.__closure__ or ()}
    assert torch.ops.aten.to.dtype in called   # to float64
    assert not {torch.ops.aten.dropout.default, torch.ops.aten.to.dtype_layout} & called


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def test_products_by_one_give_back_their_input_and_sizes_are_read_off_the_tensor(tmp_path):
    """transformers' rotary embeddings scale cos and sin by an ``attention_scaling`` of 1.0, and
    an exported decode step reads the cache's length with ``aten.sym_size.int``: the products
    are no steps (``x * 1`` is x, bit for bit, -0.0, inf and NaN included) and the size is read
    off the tensor, not through the dispatcher. A product by 1 that changes the dtype, or that
    is an output of the graph, still runs."""
    class Rotary(torch.nn.Module):
        def forward(self, x, past):
            pos = torch.arange(past.shape[1], past.shape[1] + x.shape[1], dtype=torch.float32)
            emb = pos[:, None] * x
            return torch.cat([emb.cos() * 1.0, emb.sin() * 1], -1) + past.sum(), \
                (past[0, :2, 0] > 0).long() * 1.0, x * 1.0
    x = torch.tensor([[0.0, -0.0, float("inf"), float("nan"), 1e-40, -3.5]]).t()[None, :, 0:1]
    x = x.expand(1, 6, 4).contiguous()
    length = torch.export.Dim("length", min=1, max=64)
    ep = torch.export.export(Rotary(), (x, torch.randn(1, 5, 2)),
                             dynamic_shapes=({}, {1: length}))
    targets = [n.target for n in ep.graph.nodes]
    assert torch.ops.aten.sym_size.int in targets
    assert targets.count(torch.ops.aten.mul.Tensor) >= 4
    packaged = kwker.load_package(kwker.package(ep, tmp_path / "rotary.kwk"))
    for rows in (7, 17):   # lengths not seen before (packaging may run the example's)
        past = torch.randn(1, rows, 2)
        with Calls() as ours:
            got = packaged(x, past)
        with Calls() as eager:
            want = Rotary()(x, past)
        for g, w in zip(got, want):   # bit for bit: NaN, -0.0 and tiny values as eager's
            assert g.dtype == w.dtype and torch.equal(_bits(g), _bits(w))
        assert got[2].data_ptr() != x.data_ptr()   # an output: computed, not x itself
        # the int-to-float product and the output's remain; the two of cos and sin are gone
        assert ours.count["mul"] == eager.count["mul"] - 2, (ours.count, eager.count)
    called = [c.cell_contents for s, _ in packaged._program.steps for c in s.__closure__ or ()]
    assert torch.ops.aten.sym_size.int not in called


class Positions(torch.nn.Module):
    """A rotary embedding over a past of dynamic length, as transformers' Llama computes it: cos
    and sin from the constants and the past's length alone. ``cos`` is also given out."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8.0),
                             persistent=False)

    def forward(self, x, past):
        start = past.shape[1]
        pos = torch.arange(start, start + x.shape[1]).float()
        emb = torch.cat([pos[:, None] * self.inv_freq[None, :]] * 2, -1)
        given = (emb * 2).cos()
        cos, sin = emb.cos() * 1.0, emb.sin()
        return x * cos + x * sin + past.sum(), given


def test_steps_of_constants_and_sizes_alone_run_once_per_size(tmp_path):
    """The rotary embedding's steps (``arange`` from the past's length, the product by
    ``inv_freq``, ``cat``, ``cos``, ``sin``) run for a past length not seen before only; a
    length seen again gives the kept values, bit for bit eager's. A constant changed in place is
    seen (its version keys the values), and a result the graph gives out is made on every call:
    a caller changing it changes nothing kept."""
    x = torch.randn(1, 3, 8)
    length = torch.export.Dim("length", min=1, max=64)
    model = Positions()
    ep = torch.export.export(model, (x, torch.randn(1, 5, 8)), dynamic_shapes=({}, {1: length}))
    packaged = kwker.load_package(kwker.package(ep, tmp_path / "positions.kwk"))
    for rows, seen in ((5, False), (9, False), (5, True), (9, True)):
        past = torch.randn(1, rows, 8)
        with Calls() as calls:
            got = packaged(x, past)
        for g, w in zip(got, model(x, past)):
            assert torch.equal(_bits(g), _bits(w))
        assert ("sin" in calls.names) == (not seen), calls.names
        assert "cos" in calls.names   # the output's, made every call
        got[1].add_(1.0)              # the caller's to change
    (inv_freq,) = [t for t in packaged._program.template
                   if isinstance(t, torch.Tensor) and torch.equal(t, model.inv_freq)]
    with torch.no_grad():
        inv_freq.mul_(3.0)
        model.inv_freq.mul_(3.0)
    past = torch.randn(1, 5, 8)
    for g, w in zip(packaged(x, past), model(x, past)):
        assert torch.equal(_bits(g), _bits(w))


def test_results_too_large_to_keep_are_made_each_time(tmp_path, monkeypatch):
    """A region's results larger than ``memo.MAX_BYTES`` (a long prompt's mask, say) are not
    kept: the steps run on every call, giving the same values."""
    from kwker.lowering import memo
    monkeypatch.setattr(memo, "MAX_BYTES", 64)
    x = torch.randn(1, 3, 8)
    length = torch.export.Dim("length", min=1, max=64)
    model = Positions()
    ep = torch.export.export(model, (x, torch.randn(1, 5, 8)), dynamic_shapes=({}, {1: length}))
    packaged = kwker.load_package(kwker.package(ep, tmp_path / "positions.kwk"))
    for _ in range(2):
        past = torch.randn(1, 7, 8)
        with Calls() as calls:
            got = packaged(x, past)
        assert "sin" in calls.names
        for g, w in zip(got, model(x, past)):
            assert torch.equal(_bits(g), _bits(w))
