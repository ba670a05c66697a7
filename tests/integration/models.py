"""Models the backend tests compile, and the helpers that compile and compare them."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import kwker.dynamo as kd

RTOL, ATOL = 1e-4, 1e-5


class Ranker(torch.nn.Module):
    """The tutorial's scoring model: query MLP, scores against 20,000 items, top 10."""

    def __init__(self, n_items=20_000, dim=128):
        super().__init__()
        self.query = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                         torch.nn.Linear(256, dim))
        self.items = torch.nn.Parameter(torch.randn(n_items, dim) / dim**0.5)

    def forward(self, x):
        scores = self.query(x) @ self.items.t()
        return torch.topk(scores, 10, dim=-1)


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                               torch.nn.Linear(4096, 1024))


def encoder_layer():
    return torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                            batch_first=True, activation="gelu")


class DecoderBlock(torch.nn.Module):
    """A GPT-style pre-LN decoder block: causal self-attention, tanh-GELU MLP, residuals."""

    def __init__(self, d=384, heads=6):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GroupedQuery(torch.nn.Module):
    """Causal grouped-query attention (8 query heads, 2 k/v heads), the k/v heads shared either
    through ``enable_gqa=True`` or repeated as transformers' ``repeat_kv`` does."""

    def __init__(self, d=256, heads=8, kv_heads=2, repeat="flag"):
        super().__init__()
        self.heads, self.kv_heads, self.repeat = heads, kv_heads, repeat
        self.hd = d // heads
        self.q = torch.nn.Linear(d, d)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(d, d)

    def _repeat(self, x):
        b, h, n, e = x.shape
        r = self.heads // h
        if self.repeat == "interleave":
            return x.repeat_interleave(r, dim=1)
        return x[:, :, None, :, :].expand(b, h, r, n, e).reshape(b, h * r, n, e)

    def forward(self, x):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, self.hd).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, self.hd).transpose(1, 2)
                for t in self.kv(x).split(self.kv_heads * self.hd, dim=-1))
        if self.repeat == "flag":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            a = F.scaled_dot_product_attention(q, self._repeat(k), self._repeat(v),
                                               is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, n, d))


class Attention(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


class OddSizes(torch.nn.Module):
    """Prime sizes everywhere, so every kernel takes its edge (tail) paths."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(13, 127)
        self.l2 = torch.nn.Linear(127, 1021)
        self.l3 = torch.nn.Linear(1021, 7, bias=False)
        self.l4 = torch.nn.Linear(7, 7)
        self.items = torch.nn.Parameter(torch.randn(1021, 7))
        self.attn = torch.nn.MultiheadAttention(7, 7, batch_first=True)

    def forward(self, x, seq, mask):
        h = torch.relu(self.l1(x))                       # (7, 127) relu epilogue
        h = F.gelu(self.l2(h), approximate="tanh")       # (7, 1021) tanh GELU epilogue
        o = self.l3(h)                                   # (7, 7), no bias
        o = self.l4(o) + o                               # residual epilogue
        best = torch.topk(o @ self.items.t(), 13, dim=-1)  # GEMM + topk, k=13 of 1021
        a = F.scaled_dot_product_attention(seq, seq, seq, is_causal=True)     # (3, 13, 7)
        b = F.scaled_dot_product_attention(seq, seq, seq, attn_mask=mask)     # float mask
        s = torch.bmm(seq, seq.transpose(1, 2))           # (3, 13, 13), b = k.mT
        g = F.gelu(seq * 3)                               # standalone exact GELU
        m = self.attn(seq, seq, seq, need_weights=False)[0]  # nn.MultiheadAttention
        return o, best.values, best.indices, a, b, s, g, m


def compile_run(model, inputs, inner: str, dynamic=None, grad=False):
    """(eager result, compiled result, reports of this compile)."""
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner}, dynamic=dynamic)
    with torch.set_grad_enabled(grad):
        expected = model(*inputs)
        got = compiled(*inputs)
    return expected, got, kd.all_reports()


def assert_close(got, expected, rtol=RTOL, atol=ATOL):
    got = got if isinstance(got, (tuple, list)) else (got,)
    expected = expected if isinstance(expected, (tuple, list)) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        if isinstance(e, torch.Tensor) and e.is_floating_point():
            torch.testing.assert_close(g, e, rtol=rtol, atol=atol)
        elif isinstance(e, torch.Tensor):
            assert torch.equal(g, e)
        else:
            assert g == e


def kernels(reports) -> list[str]:
    return sorted(k for r in reports for k in r.kernel_names)


def max_error(got, reference) -> float:
    return (got.double() - reference.double()).abs().max().item()


def assert_bf16_contract(got, eager, reference):
    """Kwker's bf16 result at least as close to the float32 model as eager bf16's: max abs error
    <= 1.25 x eager's + 1e-3 x max|reference| (the bf16 issue's contract)."""
    got = got if isinstance(got, (tuple, list)) else (got,)
    eager = eager if isinstance(eager, (tuple, list)) else (eager,)
    reference = reference if isinstance(reference, (tuple, list)) else (reference,)
    for g, e, r in zip(got, eager, reference):
        if not (isinstance(r, torch.Tensor) and r.is_floating_point()):
            continue
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        bound = 1.25 * max_error(e, r) + 1e-3 * r.abs().max().item()
        assert max_error(g, r) <= bound, (max_error(g, r), max_error(e, r), bound)


def assert_no_misses(reports):
    """Every node Kwker has a kernel for became one (a silent fallback fails here)."""
    for r in reports:
        assert r.status == "lowered", str(r)
        assert not r.missed, str(r)
