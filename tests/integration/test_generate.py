"""transformers' ``generate()`` with a compiled forward, as its users write it
(``model.forward = torch.compile(model.forward, backend="kwker")``): the prompt's graph, then
decode steps whose KV cache grows by a token a call (dynamo marks that size dynamic, so they run
on the generic kernels), greedy tokens equal to eager's. A decoder with grouped-query attention,
GPT-2 and an encoder-decoder (T5: cross-attention, relative position buckets)."""
import pytest
import torch

import kwker.dynamo as kd

from .models import kernels

tf = pytest.importorskip("transformers")
VOCAB, PROMPT, NEW = 512, 12, 10


def llama():
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def gpt2():
    return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=2, n_head=4,
                                            n_positions=256))


def t5():
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=128, d_ff=256, d_kv=32, num_layers=2, num_heads=4,
        decoder_start_token_id=0))


def generate(model, prompt):
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("build,inner", [(llama, "eager"), (gpt2, "inductor"), (t5, "eager")],
                         ids=["llama-eager", "gpt2-inductor", "t5-eager"])
def test_generate_matches_eager_tokens(build, inner):
    torch.manual_seed(0)
    model = build().eval()
    prompt = torch.randint(3, VOCAB, (1, PROMPT))
    expected = generate(model, prompt)
    torch._dynamo.reset()
    kd.clear_reports()
    eager_forward = model.forward
    model.forward = torch.compile(eager_forward, backend="kwker", options={"inner": inner})
    try:
        got = generate(model, prompt)
        again = generate(model, prompt)   # the compiled graphs reused, no new sizes
    finally:
        model.forward = eager_forward
        torch._dynamo.reset()
    assert torch.equal(got, expected), (got, expected)
    assert torch.equal(again, expected)
    reports = kd.all_reports()
    assert all(r.status == "lowered" for r in reports), "\n".join(map(str, reports))
    names = kernels(reports)
    # every graph, the prompt's and the decode steps', has its linears on Kwker
    assert names.count("linear") + names.count("linear_gelu_tanh") >= 2 * len(reports), names
    # the decode steps' graph is generic over the cache length
    assert any("generic" in r.kernel_sizes for r in reports), "\n".join(map(str, reports))
