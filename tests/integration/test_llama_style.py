"""Llama-style models (transformers' LlamaForCausalLM: RMSNorm, SwiGLU MLP, grouped-query
attention, rotary embeddings): their RMSNorms, ``silu(gate) * up`` and the rotary embedding of q
and k become Kwker kernels beside the linears and attention, in both inner modes, float32 and
bf16; ``nn.RMSNorm`` too; with torchao int4 weights greedy decoding gives eager torchao's
tokens."""
import pytest
import torch

import kwker.dynamo as kd

from .models import assert_bf16_contract, compile_run, greedy_tokens, kernels

tf = pytest.importorskip("transformers")


def llama(layers=2, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256)
    return tf.LlamaForCausalLM(cfg).eval().to(dtype)


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_llama_norms_and_gates_are_kernels(inner):
    ids = torch.randint(0, 512, (2, 24))
    expected, got, reports = compile_run(Logits(llama()), (ids,), inner)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    names = kernels(reports)
    assert names.count("rms_norm") == 5 and names.count("silu_mul") == 2, names
    assert names.count("rope") == 4, names   # q and k of each layer


def test_llama_bf16_keeps_the_contract():
    ids = torch.randint(0, 512, (1, 24))
    reference = Logits(llama())
    model = Logits(llama(dtype=torch.bfloat16))
    with torch.no_grad():
        eager, got, reports = compile_run(model, (ids,), "eager")
        ref = reference(ids)
    names = kernels(reports)
    assert names.count("rms_norm") == 5 and names.count("silu_mul") == 2, names
    assert names.count("rope") == 4, names
    assert_bf16_contract(got, eager, ref)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_llama_under_autocast(inner):
    """bf16 projections and float32 cos/sin (the rotary embedding promotes to float32, as
    eager's does): the rotary embeddings are kernels too, and so is the grouped-query
    attention, whose repeated float32 k heads autocast casts to bf16 (the kernel casts the
    unrepeated ones); the contract holds."""
    ids = torch.randint(0, 512, (1, 24))
    model = Logits(llama())
    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    with torch.no_grad():
        ref = model(ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager, got = model(ids), compiled(ids)
    names = kernels(kd.all_reports())
    assert names.count("rope") == 4 and names.count("sdpa") == 2, names
    assert_bf16_contract(got, eager, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_nn_rmsnorm_module(dtype):
    """``nn.RMSNorm`` (``F.rms_norm``: one rounding, ATen's default eps)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.RMSNorm(96)).to(dtype)
    with torch.no_grad():
        model[1].weight.copy_(torch.randn(96))
    x = torch.randn(7, 64).to(dtype)
    expected, got, reports = compile_run(model, (x,), "eager")
    assert "rms_norm" in kernels(reports)
    tol = {} if dtype == torch.float32 else {"rtol": 2 ** -7, "atol": 1e-2}
    torch.testing.assert_close(got, expected, **tol)


class GemmaNorm(torch.nn.Module):
    """Gemma's RMSNorm as transformers writes it: float32 maths, the weight as ``1 + w``, one
    rounding after it (Llama's rounds before its weight)."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(torch.randn(d) * 0.3)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class OlmoNorm(torch.nn.Module):
    """OLMo 2's RMSNorm as transformers writes it: the weight applied in float32, then one
    rounding (``(weight * h).to(dtype)``)."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, torch.nn.Parameter(1 + torch.randn(d) * 0.3)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("norm", [GemmaNorm, OlmoNorm], ids=["gemma", "olmo"])
def test_weighted_after_norms_are_kernels(norm, dtype, inner):
    """The whole norm (weight and the cast back included) is one kernel, within one bf16
    rounding of eager's (OLMo 2's had stayed on the inner compiler in bf16)."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), norm(96)).to(dtype)
    x = torch.randn(2, 7, 64).to(dtype)
    with torch.no_grad():
        expected, got, reports = compile_run(model, (x,), inner)
    assert kernels(reports) == ["linear", "rms_norm"], kernels(reports)
    assert got.dtype == expected.dtype
    tol = {} if dtype == torch.float32 else {"rtol": 2 ** -8, "atol": 1e-6}
    torch.testing.assert_close(got, expected, **tol)


def test_gemma_bf16_keeps_the_contract():
    """transformers' Gemma in bf16: every RMSNorm a kernel (5 for 2 layers), the contract."""
    torch.manual_seed(0)
    cfg = tf.GemmaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=32, max_position_embeddings=256)
    reference = Logits(tf.GemmaForCausalLM(cfg).eval())
    model = Logits(tf.GemmaForCausalLM(cfg).eval()).to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 512, (1, 20))
    with torch.no_grad():
        eager, got, reports = compile_run(model, (ids,), "eager")
        ref = reference(ids)
    assert kernels(reports).count("rms_norm") == 5
    assert_bf16_contract(got, eager, ref)


def test_quantized_llama_greedy_tokens():
    pytest.importorskip("torchao")
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    model = llama()
    quantize_(model, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    prompt = torch.randint(0, 512, (1, 12))


    torch._dynamo.reset()
    kd.clear_reports()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    assert torch.equal(greedy_tokens(compiled, prompt), greedy_tokens(model, prompt))
    reports = kd.all_reports()
    assert any("gemm_lowbit" in s for r in reports for s in r.kernel_paths)
    assert "silu_mul" in kernels(reports) and "rms_norm" in kernels(reports)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_bf16_packages_lower_the_norms(family, tmp_path):
    """torch.export writes a metadata assert beside each cast, a second user of the norm's
    float32 product, and Gemma's final cast as aten.type_as: the norms are kernels anyway."""
    import copy

    import kwker
    torch.manual_seed(0)
    if family == "llama":
        base = llama()
    else:
        cfg = tf.GemmaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                             head_dim=32, max_position_embeddings=256)
        base = tf.GemmaForCausalLM(cfg).eval()
    model, reference = Logits(copy.deepcopy(base)).to(torch.bfloat16), Logits(base)
    ids = torch.randint(0, 512, (1, 16))
    with torch.no_grad():
        ep = torch.export.export(model, (ids,))
        pkg = kwker.load_package(kwker.package(ep, tmp_path / "model.kwk"))
        got, eager, ref = pkg(ids), model(ids), reference(ids)
    assert [k[0] for k in pkg.report.kernels].count("rms_norm") == 5, str(pkg.report)
    assert_bf16_contract(got, eager, ref)
