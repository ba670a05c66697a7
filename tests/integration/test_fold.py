"""Input-independent nodes folded at compile time (lowering/fold.py): transformers-style masks
built from aranges become one constant, a causal one becomes ``is_causal=True``; anything random
or reading an input still runs every call."""
import pytest
import torch
import torch.nn.functional as F

import kwker.dynamo as kd

from .models import assert_close, compile_run, kernels


class MaskedAttention(torch.nn.Module):
    """Attention whose boolean mask is built per call from aranges, as transformers builds it:
    ``kind`` "causal" (key <= query), "band" (key within 3 of the query: not causal) or
    "noisy" (causal, then a random draw that must not be folded)."""

    def __init__(self, kind: str, d=96, heads=4):
        super().__init__()
        self.kind, self.heads = kind, heads
        self.qkv = torch.nn.Linear(d, 3 * d)

    def forward(self, x):
        b, length, d = x.shape
        q, k, v = (t.view(b, length, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=-1))
        rows = torch.arange(length)[:, None]
        cols = torch.arange(length)[None, :]
        mask = cols <= rows if self.kind != "band" else (rows - cols).abs() <= 3
        mask = mask[None, None].expand(b, 1, length, length)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if self.kind == "noisy":
            out = out + 0 * torch.rand(length, d // self.heads)
        return out


def _specs(reports):
    return [s for r in reports for s in r.specs if type(s).__name__ == "AttentionSpec"]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("kind, attention", [("causal", (True, "none")), ("band", (False, "bool"))])
def test_a_mask_built_from_aranges_is_folded(kind, attention, inner):
    """Both masks are computed at compile time (no arange, comparison or expand left to run);
    the causal one becomes is_causal=True, the band stays a mask."""
    torch.manual_seed(3)
    ref, out, reports = compile_run(MaskedAttention(kind).eval(), (torch.randn(2, 36, 96),),
                                    inner)
    assert_close(out, ref)
    assert kernels(reports) == ["linear", "sdpa"]
    assert [(s.causal, s.mask) for s in _specs(reports)] == [attention]
    left = [op for r in reports for _, op in r.inner_nodes]
    assert not any(op in ("arange", "le", ".expand()") for op in left), left


def test_random_draws_are_not_folded():
    torch.manual_seed(5)
    model = MaskedAttention("noisy").eval()
    x = torch.randn(2, 36, 96)
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    with torch.no_grad():
        compiled(x)
    report = kd.last_report()
    assert any(op == "rand" for _, op in report.inner_nodes), str(report)


class Buckets(torch.nn.Module):
    """T5's relative position buckets: an input-independent tensor, then written in place."""

    def __init__(self, d=8):
        super().__init__()
        self.emb, self.lin = torch.nn.Embedding(32, d), torch.nn.Linear(d, d)

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        buckets = (pos > 0).to(torch.long) * 16
        buckets += pos.abs().clamp(max=15)
        return self.lin(x) + self.emb(buckets).sum(1)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_constant_written_in_place_is_not_folded(inner):
    """The in-place add runs on a fresh tensor every call: folded, it would add to the kept
    constant each time (out-of-range embedding indices by the second call)."""
    torch.manual_seed(6)
    model, x = Buckets().eval(), torch.randn(2, 12, 8)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    with torch.no_grad():
        ref = model(x)
        for _ in range(3):
            assert_close(compiled(x), ref)


class WrittenThroughAView(torch.nn.Module):
    """An input-independent tensor written through a view that reads the input (not folded)."""

    def forward(self, x):
        c = torch.zeros(x.shape[-1])
        v = c.view_as(x[0, 0])
        v += 1
        return x + c


class FilledByAMask(torch.nn.Module):
    """A constant mask that an in-place ``masked_fill_`` reads but does not write."""

    def forward(self, x):
        n = x.shape[-1]
        mask = torch.arange(n)[None, :] > torch.arange(n)[:, None]
        return (x @ x.transpose(-1, -2)).masked_fill_(mask, -1.0)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_what_in_place_ops_write_and_read(inner):
    """Written through an unfolded view: not folded (each call starts from zeros); only read
    by an in-place op (the mask of masked_fill_): still folded."""
    x = torch.randn(2, 6, 6)
    for model in (WrittenThroughAView(), FilledByAMask()):
        torch._dynamo.reset()
        kd.clear_reports()
        compiled = torch.compile(model, backend="kwker", options={"inner": inner})
        with torch.no_grad():
            for _ in range(3):
                assert_close(compiled(x), model(x))
    left = [op for r in kd.all_reports() for _, op in r.inner_nodes]
    assert "arange" not in left and "gt" not in left, left
