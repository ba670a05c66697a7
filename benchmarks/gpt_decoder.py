"""A GPT-style decoder with a KV cache and greedy generation: the dynamic-shapes workload.

Each decode step feeds one token and a cache one position longer than the step before, so
the attention's key length changes on every call: under ``torch.compile`` dynamo marks it
dynamic after the second step, and Kwker must serve every later length without compiling.
Written the way such models are (pre-LN blocks, fused qkv projection, ``torch.cat`` onto the
cache, causal attention for the prompt and plain attention for a single new token).
Shared by benchmarks/bench_dynamic.py and the tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, past_k, past_v):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if past_k is not None:
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.out(F.gelu(self.fc(self.ln2(x))))
        return x, k, v


class GPTDecoder(nn.Module):
    """``forward(ids, past) -> (logits of the last position, new past)``; ``past`` is a tuple
    of (k, v) per layer or None for the prompt."""

    def __init__(self, vocab: int = 8192, d: int = 384, heads: int = 6, layers: int = 6,
                 max_len: int = 512):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids, past=None):
        start = 0 if past is None else past[0][0].shape[2]
        positions = torch.arange(start, start + ids.shape[1])
        x = self.tok(ids) + self.pos(positions)
        new_past = []
        for i, block in enumerate(self.blocks):
            pk, pv = (None, None) if past is None else past[i]
            x, k, v = block(x, pk, pv)
            new_past.append((k, v))
        return self.head(self.ln_f(x[:, -1])), tuple(new_past)


@torch.no_grad()
def generate(step, prompt: torch.Tensor, tokens: int) -> torch.Tensor:
    """Greedy decoding: ``tokens`` new ids after ``prompt`` (B, T), with ``step`` the model (or
    its compiled form)."""
    logits, past = step(prompt, None)
    out = []
    for _ in range(tokens):
        nxt = logits.argmax(-1, keepdim=True)
        out.append(nxt)
        logits, past = step(nxt, past)
    return torch.cat(out, dim=1)
