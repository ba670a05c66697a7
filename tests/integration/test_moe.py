"""Mixtures of experts: the grouped matmul of each expert's run of rows (``torch._grouped_mm``,
and transformers' fallback op its MoE layers call under ``torch.compile`` in float32) becomes
Kwker's grouped linear, in both inner modes, float32 and bf16."""
import pytest
import torch
import torch.nn.functional as F

from .models import assert_bf16_contract, compile_run, kernels


class Experts(torch.nn.Module):
    """Top-2 routing, rows sorted by expert, two grouped matmuls (weights as nn.Linear's
    (E, N, K), so the calls take their transposes), as transformers' grouped_mm experts."""

    def __init__(self, d=64, hidden=96, experts=6, top=2):
        super().__init__()
        self.top, self.experts = top, experts
        self.router = torch.nn.Linear(d, experts, bias=False)
        self.up = torch.nn.Parameter(torch.randn(experts, hidden, d) / d ** 0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, d, hidden) / hidden ** 0.5)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), self.top, dim=-1)
        ids, order = torch.sort(chosen.reshape(-1))
        rows = tokens[order // self.top]
        counts = torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(rows, self.up.transpose(-2, -1), offs=offs))
        out = torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offs)
        out = out * weights.reshape(-1)[order, None]
        back = torch.empty_like(out)
        back[order] = out
        return back.view(-1, self.top, x.shape[-1]).sum(1).view(x.shape)


def bf16_experts():
    """(the float32 reference, its bf16 copy, a float32 input)."""
    torch.manual_seed(0)
    reference = Experts().eval()
    model = Experts().eval()
    model.load_state_dict(reference.state_dict())
    return reference, model.to(torch.bfloat16), torch.randn(3, 40, 64)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_grouped_matmuls_are_kernels(inner):
    """bf16 (``torch._grouped_mm`` traces in bf16 only), against the float32 model."""
    reference, model, x = bf16_experts()
    with torch.no_grad():
        eager, got, reports = compile_run(model, (x.to(torch.bfloat16),), inner)
        ref = reference(x)
    assert kernels(reports).count("grouped_mm") == 2, kernels(reports)
    assert_bf16_contract(got, eager, ref)


tf = pytest.importorskip("transformers")


def qwen3_moe(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16)
    return tf.Qwen3MoeModel(cfg).eval().to(dtype)


class Hidden(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).last_hidden_state


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_transformers_moe_float32(inner):
    """Under torch.compile transformers sends float32 experts to its own fallback op."""
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        expected, got, reports = compile_run(Hidden(qwen3_moe()), (ids,), inner)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert kernels(reports).count("grouped_mm") == 4, kernels(reports)


def test_transformers_moe_bf16_keeps_the_contract():
    ids = torch.randint(0, 256, (1, 24))
    reference, model = Hidden(qwen3_moe()), Hidden(qwen3_moe(torch.bfloat16))
    with torch.no_grad():
        eager, got, reports = compile_run(model, (ids,), "eager")
        ref = reference(ids)
    assert kernels(reports).count("grouped_mm") == 4
    assert_bf16_contract(got, eager, ref)


def test_packaged_moe(tmp_path):
    """An exported bf16 MoE (aten._grouped_mm with its runs as a positional argument) packaged:
    both grouped matmuls are kernels, and the bf16 contract holds."""
    import kwker
    reference, model, x = bf16_experts()
    ep = torch.export.export(model, (x.to(torch.bfloat16),))
    loaded = kwker.load_package(kwker.package(ep, tmp_path / "moe.kwk"))
    assert loaded.report.kernel_names.count("grouped_mm") == 2, loaded.report.kernel_names
    with torch.no_grad():
        assert_bf16_contract(loaded(x.to(torch.bfloat16)), model(x.to(torch.bfloat16)),
                             reference(x))
