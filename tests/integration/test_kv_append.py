"""KV caches appended in place under ``inner="eager"``: the decoder's ``cat`` onto its cache
becomes ``kv_append``, which writes each step's keys and values after the past instead of
copying it; tokens stay eager's."""
import pytest
import torch
import torch.nn.functional as F

import kwker.dynamo as kd
from kwker.kernels.kv_cache import capacity

from .models import GPTDecoder, generate


@pytest.fixture(autouse=True)
def fresh():
    torch._dynamo.reset()
    kd.clear_reports()


def test_decoding_appends_in_place_with_eager_tokens():
    torch.manual_seed(0)
    model = GPTDecoder(vocab=256, d=64, heads=4, layers=2, max_len=128).eval()
    prompt = torch.randint(0, 256, (1, 9))
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    keys = []

    def step(ids, past):
        logits, past = compiled(ids, past)
        keys.append(past[0][0])
        return logits, past

    assert torch.equal(generate(step, prompt, 80), generate(model, prompt, 80))
    # the prompt's cache is contiguous; from the first appended step on, every step's keys
    # are a longer view of one buffer until it fills, then of the next
    ptrs = [k.data_ptr() for k in keys[1:]]
    full = capacity(prompt.shape[1] + 1) - prompt.shape[1]
    assert len(set(ptrs)) == 2 and ptrs.index(ptrs[-1]) == full, ptrs
    assert not keys[1].is_contiguous()       # rows of the buffer's capacity apart
    decode = kd.all_reports()[-1]
    assert decode.kernel_names.count("kv_append") == 4, decode


class _CacheStep(torch.nn.Module):
    """Attention over a cache, followed by elementwise work Inductor fuses."""

    def forward(self, q, past, new):
        k = torch.cat([past, new], dim=2)
        a = F.scaled_dot_product_attention(q, k, k)
        return torch.sin(a) * torch.cos(a) + a.exp(), k


def test_graphs_inductor_compiles_keep_their_cat():
    """Inductor's code assumes the layouts it was compiled for: only the flat program (which
    ``inner="inductor"`` also runs for graphs with little left to fuse, a decode step's) takes
    the in-place append."""
    torch.manual_seed(0)
    q, past, new = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 1, 8)
    compiled = torch.compile(_CacheStep(), backend="kwker", options={"inner": "inductor"})
    got, ref = compiled(q, past, new), _CacheStep()(q, past, new)
    assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(got, ref))
    report = kd.last_report()
    assert "flat program" not in (report.reason or "") and "sdpa" in report.kernel_names
    assert "kv_append" not in report.kernel_names, report


class _Reads(torch.nn.Module):
    """A cache step whose concatenated keys are read by more than attention."""

    def forward(self, q, past, new):
        k = torch.cat([past, new], dim=2)
        return F.scaled_dot_product_attention(q, k, k) + k.sum(), k


def test_a_cat_read_by_other_ops_stays_a_cat():
    torch.manual_seed(0)
    q, past, new = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 1, 8)
    compiled = torch.compile(_Reads(), backend="kwker", options={"inner": "eager"})
    got, ref = compiled(q, past, new), _Reads()(q, past, new)
    assert all(torch.allclose(g, r, atol=1e-5) for g, r in zip(got, ref))
    assert got[1].is_contiguous()
    assert "kv_append" not in kd.last_report().kernel_names


def test_bf16_decode_attention_is_lowered_on_tiles_cpus(native_tiles):
    """On a CPU with AMX, bf16 attention of one query (a decode step) runs on Kwker's
    few-query kernel (no tile path needed), not on ATen's flash attention: each step's logits
    as close to the float32 model's as eager bf16's are, fed the same tokens."""
    from .models import assert_bf16_contract
    torch.manual_seed(0)
    model = GPTDecoder(vocab=256, d=64, heads=4, layers=2, max_len=128).eval()
    low = GPTDecoder(vocab=256, d=64, heads=4, layers=2, max_len=128).eval()
    low.load_state_dict(model.state_dict())
    low = low.to(torch.bfloat16)
    compiled = torch.compile(low, backend="kwker", options={"inner": "eager"})
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref, past_ref = model(ids, None)
        eager, past_eager = low(ids, None)
        got, past_got = compiled(ids, None)
        for _ in range(6):
            ids = ref.argmax(-1, keepdim=True)
            ref, past_ref = model(ids, past_ref)
            eager, past_eager = low(ids, past_eager)
            got, past_got = compiled(ids, past_got)
            assert_bf16_contract(got, eager, ref)
    decode = kd.all_reports()[-1]
    assert "sdpa" in decode.kernel_names or "sdpa_kv_append" in decode.kernel_names, decode
    assert not decode.missed, decode
