"""Models the backend tests compile, and the helpers that compile and compare them.

The tutorial Ranker, the GPT-style decoder block, bare attention and the KV-cache decoder are
the benchmarks' own (benchmarks/model_defs.py, gpt_decoder.py): the tests check the models the
figures are measured on.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import kwker.dynamo as kd

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpt_decoder import GPTDecoder, generate  # noqa: E402,F401 - shared, re-exported
from model_defs import Attention, DecoderBlock, Ranker  # noqa: E402,F401

RTOL, ATOL = 1e-4, 1e-5


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                               torch.nn.Linear(4096, 1024))


def encoder_layer():
    return torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                            batch_first=True, activation="gelu")


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


def greedy_tokens(model, prompt, steps: int = 64):
    """``steps`` greedy tokens of a transformers causal LM from ``prompt``, with its KV cache."""
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        tokens = [out.logits[:, -1:].argmax(-1)]
        for _ in range(steps - 1):
            out = model(input_ids=tokens[-1], past_key_values=out.past_key_values,
                        use_cache=True)
            tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, 1)
