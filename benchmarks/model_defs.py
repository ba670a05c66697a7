"""The models bench_models.py times: the float32 set (``MODELS``) and the bfloat16 set
(``BF16_MODELS``), each a builder returning ``(model, inputs)`` from a fixed seed.

The bf16 set adds a GPT-style decoder block, a 12-layer 768-wide encoder and, with the ``bench``
extra, two Hugging Face ``transformers`` models built from small configs with random weights (no
download: ``HF_HUB_OFFLINE=1``). A builder whose library is missing raises ``Missing``.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


class Missing(RuntimeError):
    """A model's library is not installed; the message says what to install."""


# --------------------------------------------------------------------------- float32 set
class Ranker(torch.nn.Module):
    def __init__(self, n_items=20_000, dim=128):
        super().__init__()
        self.query = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                         torch.nn.Linear(256, dim))
        self.items = torch.nn.Parameter(torch.randn(n_items, dim) / dim**0.5)

    def forward(self, x):
        scores = self.query(x) @ self.items.t()
        return torch.topk(scores, 10, dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _ranker(b):
    return Ranker(), (torch.randn(b, 64),)


def _mlp(b):
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 1024))
    return m, (torch.randn(b, 1024),)


def _encoder():
    m = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                         batch_first=True, activation="gelu")
    return m, (torch.randn(8, 128, 256),)


def _sdpa(causal):
    return Attention(causal), tuple(torch.randn(8, 8, 128, 32) for _ in range(3))


class WrittenAttentionBlock(torch.nn.Module):
    """A GPT-style pre-LN block with its attention written out as nanoGPT writes it (scores,
    a causal ``masked_fill`` from a buffer, softmax, product with v): Kwker matches it as
    attention (lowering/composite.py)."""

    def __init__(self, d=384, heads=6, max_len=256):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len))
                             .view(1, 1, max_len, max_len))

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(d, dim=-1))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        att = att.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        a = F.softmax(att, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


MODELS = {
    "tutorial Ranker b1": lambda: _ranker(1),
    "tutorial Ranker b32": lambda: _ranker(32),
    "tutorial Ranker b256": lambda: _ranker(256),
    "MLP 1024-4096-1024 b1": lambda: _mlp(1),
    "MLP 1024-4096-1024 b64": lambda: _mlp(64),
    "TransformerEncoderLayer (8,128,256)": _encoder,
    "SDPA (8,8,128,32)": lambda: _sdpa(False),
    "SDPA causal (8,8,128,32)": lambda: _sdpa(True),
    "nanoGPT block, attention written out (1,256,384)":
        lambda: (WrittenAttentionBlock(), (torch.randn(1, 256, 384),)),
}
TUTORIAL = "tutorial Ranker b32"


def build(name: str, models: dict | None = None):
    """``(model.eval(), inputs)`` of ``name`` (from ``MODELS`` unless ``models`` is given),
    float32, seeded, so every variant and every run sees the same weights and inputs."""
    torch.manual_seed(0)
    model, inputs = (MODELS if models is None else models)[name]()
    return model.eval(), inputs


# --------------------------------------------------------------------------- bf16 additions
class DecoderBlock(torch.nn.Module):
    """GPT-style pre-LN decoder block: causal self-attention, tanh-GELU MLP, two residuals."""

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


def _decoder():
    return DecoderBlock(), (torch.randn(1, 128, 384),)


def _encoder12():
    layer = torch.nn.TransformerEncoderLayer(d_model=768, nhead=12, dim_feedforward=3072,
                                             batch_first=True)
    m = torch.nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False)
    return m, (torch.randn(8, 128, 768),)


class LastHidden(torch.nn.Module):
    """A ``transformers`` model called with ``input_ids`` only, returning
    ``last_hidden_state``: one tensor in, one out, as the peers' converters want."""

    def __init__(self, model, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, ids):
        return self.model(input_ids=ids, **self.kwargs).last_hidden_state


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights from a config: never download
    try:
        import transformers
    except ImportError as e:
        raise Missing(f'transformers not installed: pip install -e ".[bench]" ({e})') from None
    transformers.logging.set_verbosity_error()
    return transformers


def _bert():
    """BertModel, 4 layers, 256 wide, 4 heads, FFN 1024, SDPA attention, at 8 x 128 tokens."""
    tf = _transformers()
    cfg = tf.BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=512, attn_implementation="sdpa")
    return LastHidden(tf.BertModel(cfg, add_pooling_layer=False)), (
        torch.randint(0, cfg.vocab_size, (8, 128)),)


def _gpt2():
    """GPT2Model, 4 layers, 384 wide, 6 heads, SDPA attention, at 1 x 128 tokens."""
    tf = _transformers()
    cfg = tf.GPT2Config(vocab_size=8192, n_embd=384, n_layer=4, n_head=6, n_positions=512,
                        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    ids = torch.randint(0, cfg.vocab_size, (1, 128))
    return LastHidden(tf.GPT2Model(cfg), use_cache=False), (ids,)


def llama_config(width: int = 768, layers: int = 12, vocab: int = 32000, **extra):
    """A Llama of GPT-2's size by default: 12 layers, 768 wide, grouped-query attention (12
    heads, 4 for k/v), SwiGLU MLP 2048 wide, RMSNorm, 32000 tokens."""
    tf = _transformers()
    return tf.LlamaConfig(vocab_size=vocab, hidden_size=width,
                          intermediate_size=width * 8 // 3 // 32 * 32, num_hidden_layers=layers,
                          num_attention_heads=width // 64, num_key_value_heads=max(1, width // 192),
                          max_position_embeddings=1024, **extra)


def _bert_base():
    """BERT-base (transformers' BertConfig defaults: 12 layers, 768 wide), 8 x 128 tokens."""
    tf = _transformers()
    cfg = tf.BertConfig(attn_implementation="sdpa")
    return LastHidden(tf.BertModel(cfg, add_pooling_layer=False)), (
        torch.randint(0, cfg.vocab_size, (8, 128)),)


def _gpt2_base():
    """GPT-2 (transformers' GPT2Config defaults: 124M parameters), 1 x 128 tokens, no cache."""
    tf = _transformers()
    cfg = tf.GPT2Config(attn_implementation="sdpa")
    return LastHidden(tf.GPT2Model(cfg), use_cache=False), (
        torch.randint(0, cfg.vocab_size, (1, 128)),)


def _llama_base():
    """The Llama of ``llama_config()``, 1 x 128 tokens, no cache."""
    tf = _transformers()
    cfg = llama_config(attn_implementation="sdpa")
    return LastHidden(tf.LlamaModel(cfg), use_cache=False), (
        torch.randint(0, cfg.vocab_size, (1, 128)),)


def _qwen3_moe_base():
    """A Qwen3-MoE of GPT-2's size: 12 layers, 768 wide, grouped-query attention, 8 experts of
    768 -> 1024 -> 768 each, 2 per token (as Qwen3-30B-A3B routes, scaled down), 1 x 128 tokens,
    no cache."""
    tf = _transformers()
    cfg = tf.Qwen3MoeConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                            moe_intermediate_size=1024, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                            head_dim=64, attn_implementation="sdpa")
    return LastHidden(tf.Qwen3MoeModel(cfg), use_cache=False), (
        torch.randint(0, cfg.vocab_size, (1, 128)),)


# bench_transformers.py: full-size transformers models, name -> (builder, target ratio eager
# bf16 / Kwker or None, must beat OpenVINO bf16) as in BF16_MODELS; in float32 they share issue
# 19's geomean target, in bf16 the AMX issue's targets hold on a CPU with AMX
TRANSFORMERS = {
    "BERT-base (8,128)": (_bert_base, None, False),
    "GPT-2 (1,128)": (_gpt2_base, None, False),
    "Llama 12x768 GQA (1,128)": (_llama_base, None, False),
    "Qwen3-MoE 12x768, 8 experts (1,128)": (_qwen3_moe_base, None, False),
}
# the models of issue 19's float32 geomean (the others count towards its floor only)
TRANSFORMERS_GEOMEAN = ("BERT-base (8,128)", "GPT-2 (1,128)", "Llama 12x768 GQA (1,128)")
TRANSFORMERS_TARGETS_AMX = {"BERT-base (8,128)": (1.3, True), "GPT-2 (1,128)": (1.3, True)}

# name -> (builder, target ratio eager bf16 / Kwker or None, must beat OpenVINO bf16)
BF16_MODELS = {
    "TransformerEncoderLayer (8,128,256)": (_encoder, 1.2, True),
    "GPT decoder block d384 (1,128)": (_decoder, 1.25, False),
    "MLP 1024-4096-1024 b64": (lambda: _mlp(64), 1.15, False),
    "MLP 1024-4096-1024 b1": (lambda: _mlp(1), 1.8, False),
    "tutorial Ranker b32": (lambda: _ranker(32), 2.2, False),
    "12-layer encoder 768 (8,128)": (_encoder12, None, True),
    "transformers BertModel 4x256 (8,128)": (_bert, None, False),
    "transformers GPT2Model 4x384 (1,128)": (_gpt2, None, False),
}
# on a CPU with AMX tiles (eager bf16 on oneDNN's tile kernels): the AMX issue's targets,
# (ratio vs eager bf16, must be ahead of OpenVINO bf16)
BF16_TARGETS_AMX = {
    "TransformerEncoderLayer (8,128,256)": (1.3, True),
    "GPT decoder block d384 (1,128)": (1.3, False),
    "MLP 1024-4096-1024 b64": (1.3, False),
    "MLP 1024-4096-1024 b1": (1.8, False),
    "tutorial Ranker b32": (2.2, False),
    "12-layer encoder 768 (8,128)": (None, True),
    "transformers BertModel 4x256 (8,128)": (1.3, True),
    "transformers GPT2Model 4x384 (1,128)": (1.3, True),
}
# the rows also run without AVX512_BF16 (AVX2 path, in a child process)
AVX2_MODELS = ("TransformerEncoderLayer (8,128,256)", "MLP 1024-4096-1024 b64",
               "MLP 1024-4096-1024 b1", "GPT decoder block d384 (1,128)")
