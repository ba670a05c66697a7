"""Attention written out (``softmax(q @ k^T * c [+ mask]) @ v``: nanoGPT, transformers' eager
attention, hand-written blocks) runs as the SDPA kernel, with what the written form gives: a
row with no finite score is NaN, the output contiguous. Look-alikes stay on the inner compiler."""
import math

import pytest
import torch
import torch.nn.functional as F

from .models import assert_bf16_contract, assert_close, compile_run, kernels

INNERS = ["eager", "inductor"]


class Heads(torch.nn.Module):
    """q, k, v heads from one projection, then ``attend`` (the form under test)."""

    def __init__(self, d=96, h=4, t=40):
        super().__init__()
        self.h, self.qkv, self.o = h, torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))

    def forward(self, x, mask=None):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))
        y = self.attend(q, k, v, mask)
        return self.o(y.transpose(1, 2).contiguous().view(b, t, c))


class Scaled(Heads):        # a hand-written block: divided by sqrt(d)
    def attend(self, q, k, v, mask):
        return ((q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))).softmax(-1) @ v


class NanoGPT(Heads):       # nanoGPT's CausalSelfAttention without flash
    def attend(self, q, k, v, mask):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), 0.1, training=False)
        return att @ v


class Additive(Heads):      # transformers' eager_attention_forward
    def attend(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5) + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(F.dropout(w, p=0.0, training=False), v)


class T5(Heads):            # transformers' T5: a position bias, the softmax in float32
    def attend(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(3, 2)) + mask
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        return torch.matmul(w, v)


class Bmm(torch.nn.Module):  # rank 3: (batch * heads, length, head size)
    def forward(self, q, k, v):
        return torch.bmm(F.softmax(torch.bmm(q, k.transpose(1, 2)) * 0.3, dim=2), v)


def _inputs(model, dtype=torch.float32, t=40):
    x = torch.randn(3, t, model.qkv.in_features, dtype=dtype)
    if isinstance(model, T5):
        return x, torch.randn(1, model.h, t, t, dtype=dtype)
    if isinstance(model, Additive):
        mask = torch.zeros(3, 1, t, t, dtype=dtype)
        mask[:, :, :, t // 2:] = torch.finfo(dtype).min   # padding of the second half
        mask[0, :, :, :3] = -math.inf
        return x, mask
    return (x,)


@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("form", [Scaled, NanoGPT, Additive, T5], ids=lambda c: c.__name__)
def test_written_attention_runs_as_the_sdpa_kernel(form, inner):
    torch.manual_seed(3)
    model = form().eval()
    expected, got, reports = compile_run(model, _inputs(model), inner)
    assert "sdpa" in kernels(reports), "\n".join(map(str, reports))
    assert_close(got, expected)


@pytest.mark.parametrize("inner", INNERS)
def test_rank3_bmm_form(inner):
    torch.manual_seed(4)
    q, k, v = torch.randn(6, 33, 24), torch.randn(6, 50, 24), torch.randn(6, 50, 40)
    expected, got, reports = compile_run(Bmm(), (q, k, v), inner)
    assert kernels(reports) == ["sdpa"], "\n".join(map(str, reports))
    assert_close(got, expected)
    assert got.is_contiguous()


@pytest.mark.parametrize("form", [NanoGPT, Additive, T5], ids=lambda c: c.__name__)
def test_bf16_keeps_the_bf16_contract(form):
    """Head size 32: on the tile path where the CPU has AMX, the vector path elsewhere."""
    torch.manual_seed(5)
    model = form(d=128).eval()
    inputs = _inputs(model)
    with torch.no_grad():
        reference = model(*inputs)
    low = form(d=128).eval().to(torch.bfloat16)
    low.load_state_dict(model.state_dict())
    expected, got, reports = compile_run(low, tuple(t.bfloat16() for t in inputs), "eager")
    assert "sdpa" in kernels(reports), "\n".join(map(str, reports))
    assert_bf16_contract(got, expected, reference)


class FullyMasked(torch.nn.Module):
    def forward(self, q, k, v, cond, add):
        a = (q @ k.transpose(-2, -1)).masked_fill(cond, float("-inf")).softmax(-1) @ v
        b = ((q @ k.transpose(-2, -1)) * 0.5 + add).softmax(-1) @ v
        return a, b


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("inner", INNERS)
def test_a_row_with_no_finite_score_is_nan_as_written(inner, dynamic):
    """softmax of a row of -inf is NaN (ATen's SDPA would give 0): the same rows come out NaN,
    the others as eager; NaN and inf inputs propagate as they do there."""
    torch.manual_seed(6)
    q, k, v = torch.randn(2, 3, 17, 16), torch.randn(2, 3, 21, 16), torch.randn(2, 3, 21, 16)
    cond = torch.rand(2, 3, 17, 21) < 0.3
    cond[0, 1, 4] = True                      # every key masked
    add = torch.zeros(2, 1, 17, 21)
    add[1, 0, 7] = -math.inf
    q[1, 2, 3, 5] = math.nan
    k[0, 0, 9, 2] = math.inf
    expected, got, reports = compile_run(FullyMasked(), (q, k, v, cond, add), inner,
                                         dynamic=dynamic)
    assert kernels(reports) == ["sdpa", "sdpa"], "\n".join(map(str, reports))
    for g, e in zip(got, expected):
        assert e.isnan().any()
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5, equal_nan=True)


class FillFinite(torch.nn.Module):
    """masked_fill with a finite value (the Annotated Transformer's -1e9, transformers'
    finfo.min): a fully masked row is uniform there, not NaN."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, q, k, v, cond):
        s = (q @ k.transpose(-2, -1)) / 4.0
        return s.masked_fill(cond, self.value).softmax(-1) @ v


@pytest.mark.parametrize("value", [-1e9, -1e4, -3.0, torch.finfo(torch.float32).min])
@pytest.mark.parametrize("inner", INNERS)
def test_finite_fill_values(value, inner):
    torch.manual_seed(10)
    q, k, v = torch.randn(2, 3, 13, 16), torch.randn(2, 3, 19, 16), torch.randn(2, 3, 19, 16)
    cond = torch.rand(2, 3, 13, 19) < 0.4
    cond[1, 2, 5] = True                      # every key masked: uniform weights
    expected, got, reports = compile_run(FillFinite(value), (q, k, v, cond), inner)
    assert kernels(reports) == ["sdpa"], "\n".join(map(str, reports))
    assert not expected.isnan().any()
    assert_close(got, expected)


class WeightsUsed(torch.nn.Module):      # the probabilities are an output too
    def forward(self, q, k, v):
        p = (q @ k.transpose(-2, -1) * 0.25).softmax(-1)
        return p @ v, p


class FillTensor(torch.nn.Module):       # masked_fill with a tensor value
    def forward(self, q, k, v, cond):
        s = (q @ k.transpose(-2, -1)).masked_fill(cond, q.new_tensor(-5.0))
        return s.softmax(-1) @ v


class OtherDim(torch.nn.Module):
    def forward(self, q, k, v):
        return (q @ k.transpose(-2, -1)).softmax(-2) @ v


@pytest.mark.parametrize("model", [WeightsUsed, FillTensor, OtherDim], ids=lambda c: c.__name__)
def test_look_alikes_are_not_attention(model):
    torch.manual_seed(7)
    q, k, v = torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    inputs = (q, k, v) if model is not FillTensor else (q, k, v, torch.rand(2, 2, 12, 12) < 0.5)
    expected, got, reports = compile_run(model(), inputs, "eager")
    assert "sdpa" not in kernels(reports), "\n".join(map(str, reports))
    assert_close(got, expected)


def test_dynamic_lengths_share_one_kernel():
    torch.manual_seed(8)
    model = NanoGPT(t=64).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"}, dynamic=True)
    with torch.no_grad():
        for t in (9, 30, 64):
            x = torch.randn(2, t, 96)
            assert_close(compiled(x), model(x))


def test_packaged_written_attention(tmp_path):
    """torch.export spells it in ATen ops (aten.matmul, aten.masked_fill): matched alike."""
    import kwker
    torch.manual_seed(9)
    model = NanoGPT().eval()
    x = torch.randn(3, 40, 96)
    kwker.package(torch.export.export(model, (x,)), tmp_path / "attention.kwk")
    loaded = kwker.load_package(tmp_path / "attention.kwk")
    with torch.no_grad():
        assert_close(loaded(x), model(x))
    assert "sdpa" in loaded.report.kernel_names, str(loaded.report)


class FoldedCausal(torch.nn.Module):
    """An additive causal mask built from sizes alone (folded at compile time; transformers'
    eager attention adds one of finfo.min): the kernel runs causal, reading no mask."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, q, k, v):
        t = q.shape[-2]
        i = torch.arange(t)
        mask = torch.where(i[None, :] <= i[:, None], 0.0, self.value)
        return (torch.matmul(q, k.transpose(-1, -2)) * 0.25 + mask).softmax(-1) @ v


class FoldedCausalFill(torch.nn.Module):
    """The same as a masked_fill condition built in forward (tril(ones) == 0)."""

    def __init__(self, value):
        super().__init__()
        self.value = value

    def forward(self, q, k, v):
        t = q.shape[-2]
        keep = torch.tril(torch.ones(t, t))
        s = (q @ k.transpose(-2, -1)).masked_fill(keep == 0, self.value)
        return s.softmax(-1) @ v


@pytest.mark.parametrize("form", [FoldedCausal, FoldedCausalFill], ids=lambda c: c.__name__)
@pytest.mark.parametrize("value", [-math.inf, torch.finfo(torch.float32).min, -5.0])
def test_a_folded_causal_mask_runs_causal(value, form):
    torch.manual_seed(11)
    q, k, v = (torch.randn(2, 3, 40, 16) for _ in range(3))
    expected, got, reports = compile_run(form(value), (q, k, v), "eager")
    assert kernels(reports) == ["sdpa"], "\n".join(map(str, reports))
    causal = "_c1_" in "\n".join(map(str, reports))
    assert causal == (value != -5.0), "\n".join(map(str, reports))   # -5 is not masking
    assert_close(got, expected)


def test_products_fall_back_to_matmul_kernels(monkeypatch):
    """Where the attention kernel does not build, its two products get the matmul kernels they
    had without the pattern."""
    import kwker.lowering.build as B
    monkeypatch.setitem(B._BUILDERS, "sdpa", lambda m, metas, consts: (None, "test: no kernel"))
    torch.manual_seed(12)
    q, k, v = torch.randn(2, 3, 20, 16), torch.randn(2, 3, 24, 16), torch.randn(2, 3, 24, 16)
    expected, got, reports = compile_run(Bmm(), (q.flatten(0, 1), k.flatten(0, 1),
                                                 v.flatten(0, 1)), "eager")
    assert kernels(reports) == ["matmul", "matmul"], "\n".join(map(str, reports))
    assert_close(got, expected)


class Broadcast(torch.nn.Module):
    """One k/v head the products broadcast to every query head (multi-query attention) is the
    kernel's grouped form; other broadcasts (a batch of one, a mask of more dims than q) are
    left to the matmuls, whatever the sizes."""

    def forward(self, q, k, v, mask):
        a = (q @ k.transpose(-2, -1) * 0.3).softmax(-1) @ v
        b = (q[0] @ k[0].transpose(-2, -1) + mask).softmax(-1) @ v[0]
        c = (q @ k[:1].transpose(-2, -1)).softmax(-1) @ v[:1]
        return a, b, c


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_broadcast_heads_and_batches(dynamic):
    torch.manual_seed(13)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 1, 11, 8), torch.randn(2, 1, 11, 8)
    mask = torch.randn(3, 4, 9, 11)
    expected, got, reports = compile_run(Broadcast(), (q, k, v, mask), "eager", dynamic=dynamic)
    assert kernels(reports).count("sdpa") == 1, "\n".join(map(str, reports))
    assert_close(got, expected)
