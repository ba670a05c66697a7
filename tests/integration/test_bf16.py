"""bf16 models, both ways users write them (``model.to(torch.bfloat16)`` and autocast regions),
under both inner compilers: every GEMM/attention/GELU node becomes a bf16 Kwker kernel (counted,
so a silent fallback fails) and the result keeps the accuracy contract against the float32
model (``assert_bf16_contract``)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kwker.dynamo as kd

from .models import (DecoderBlock, GroupedQuery, Ranker, assert_bf16_contract, assert_no_misses,
                     encoder_layer)

BF16 = torch.bfloat16


class MLP(torch.nn.Module):
    def __init__(self, d=256, hidden=1024):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, hidden), torch.nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))) + x


class Matmuls(torch.nn.Module):
    """Products of two activations (kn and transposed B, batched) and a standalone GELU."""

    def forward(self, a, b):
        s = torch.bmm(a, b.transpose(1, 2))
        return F.gelu(torch.matmul(s, b) * 0.5, approximate="tanh"), s


CASES = {  # name -> (model factory, inputs, expected kernels in either form)
    "mlp": (lambda: MLP(), lambda: (torch.randn(37, 256),), ["linear_gelu", "linear_residual"]),
    "mlp_b1": (lambda: MLP(), lambda: (torch.randn(1, 256),), ["linear_gelu", "linear_residual"]),
    "encoder_layer": (encoder_layer, lambda: (torch.randn(2, 64, 256),),
                      ["linear", "linear_gelu", "linear_residual", "linear_residual", "sdpa",
                       "layer_norm", "layer_norm"]),
    "encoder_2_layers": (lambda: torch.nn.TransformerEncoder(encoder_layer(), 2),
                         lambda: (torch.randn(2, 32, 256),),
                         ["linear", "linear_gelu", "linear_residual", "linear_residual",
                          "sdpa", "layer_norm", "layer_norm"] * 2),
    "decoder_block": (lambda: DecoderBlock(), lambda: (torch.randn(1, 128, 384),),
                      ["linear", "linear_gelu_tanh", "linear_residual", "linear_residual",
                       "sdpa", "layer_norm", "layer_norm"]),
    "ranker": (lambda: Ranker(n_items=3000), lambda: (torch.randn(32, 64),),
               ["linear", "linear_gelu", "linear_topk"]),
    "gqa": (lambda: GroupedQuery(repeat="flag"), lambda: (torch.randn(2, 45, 256),),
            ["linear", "linear", "linear", "sdpa"]),
    "gqa_repeat_kv": (lambda: GroupedQuery(repeat="expand"), lambda: (torch.randn(2, 45, 256),),
                      ["linear", "linear", "linear", "sdpa"]),
    "matmuls": (lambda: Matmuls(), lambda: (torch.randn(3, 17, 33), torch.randn(3, 19, 33)),
                ["gelu", "matmul", "matmul"]),
}
# autocast keeps the float32 residual adds of MLP-like models in float32 (add promotes): the
# bf16 product is added to the float32 stream in the kernel, unrounded, with a float32 result
# (kernels.linear's ``out_dtype``). A whole encoder layer is one op on autocast's bf16 list, so
# its expansion is bf16 throughout, residuals included.


def _run(name, form, inner):
    make, inputs, expected = CASES[name]
    torch.manual_seed(1)
    model = make().eval()
    args = inputs()
    with torch.no_grad():
        reference = model(*args)
        if form == "bf16":
            low = copy.deepcopy(model).to(BF16)
            low_args = tuple(a.to(BF16) for a in args)
            eager = low(*low_args)
            torch._dynamo.reset()
            kd.clear_reports()
            compiled = torch.compile(low, backend="kwker", options={"inner": inner})
            got = compiled(*low_args)
        else:
            with torch.autocast("cpu", dtype=BF16):
                eager = model(*args)
            torch._dynamo.reset()
            kd.clear_reports()
            compiled = torch.compile(model, backend="kwker", options={"inner": inner})
            with torch.autocast("cpu", dtype=BF16):
                got = compiled(*args)
    return reference, eager, got, kd.all_reports(), expected


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("form", ["bf16", "autocast"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_bf16_model(name, form, inner):
    reference, eager, got, reports, expected = _run(name, form, inner)
    assert_bf16_contract(got, eager, reference)
    assert_no_misses(reports)
    kernels = sorted(k for r in reports for k in r.kernel_names)
    assert kernels == sorted(expected), [str(r) for r in reports]
    # layer norms run in their input's dtype, as under autocast (on neither of its lists): the
    # float32 residual stream of a pre-LN block under autocast is normalised in float32
    dtypes = {k[2] for r in reports for k in r.kernels if k[0] not in ("topk", "layer_norm")}
    assert dtypes == {"bfloat16"}, [str(r) for r in reports]
    norms = {k[2] for r in reports for k in r.kernels if k[0] == "layer_norm"}
    assert norms <= ({"bfloat16"} if form == "bf16" else {"bfloat16", "float32"}), norms
    if form == "autocast" and name == "decoder_block":
        # pre-LN: autocast's casts of the float32 norms for the bf16 products are the norms'
        assert not any(op == ".to()" for r in reports for _, op in r.inner_nodes), \
            [str(r) for r in reports]


def test_ranker_topk_follows_aten_on_the_bf16_scores():
    """The top-k of bf16 scores is ATen's, tie order included, on the scores Kwker computed:
    items repeat, so every score is tied several times."""
    class Scores(torch.nn.Module):
        def __init__(self, ranker):
            super().__init__()
            self.ranker = ranker

        def forward(self, x):
            return self.ranker.query(x) @ self.ranker.items.t()

    torch.manual_seed(2)
    ranker = Ranker(n_items=3000).eval().to(BF16)
    with torch.no_grad():
        ranker.items.copy_(ranker.items[:300].repeat(10, 1))
    x = torch.randn(8, 64, dtype=BF16)
    torch._dynamo.reset()
    top = torch.compile(ranker, backend="kwker", options={"inner": "eager"})
    with torch.no_grad():
        values, indices = top(x)
        assert kd.last_report().kernel_names == ["linear_gelu", "linear", "linear_topk"]
        scores = torch.compile(Scores(ranker), backend="kwker", options={"inner": "eager"})
        expected = torch.topk(scores(x), 10, dim=-1)
        assert kd.last_report().kernel_names == ["linear_gelu", "linear", "linear"]
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_autocast_casts_a_tensor_once_for_all_its_readers(inner):
    """The q and the k/v projections of GroupedQuery read one float32 input: under autocast it
    is cast to bf16 once, not once per product (BERT: q, k and v after each LayerNorm)."""
    reference, eager, got, reports, _ = _run("gqa", "autocast", inner)
    assert_bf16_contract(got, eager, reference)
    casts = [n for r in reports for n in r.inner_nodes if n[1] == ".to()"]
    assert len(casts) == 1, [str(r) for r in reports]


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_float32_precision_medium_puts_float32_linears_on_bf16_products(inner):
    """A float32 model compiled under ``torch.set_float32_matmul_precision("medium")`` (bf16
    products allowed) runs its linears on them where the CPU has fast ones: x and the weights
    rounded to bf16, within the bf16 contract of the float64 model, and float32 again when the
    same model is compiled back at "highest" (each inner's kernels keyed by the setting)."""
    from kwker.kernels import blocking
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # a model Inductor takes most of (embeddings, masks): it calls the linears as Kwker's ops
    model = tf.BertModel(tf.BertConfig(hidden_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=512,
                                       vocab_size=1000)).eval()
    x = torch.randint(0, 1000, (2, 32))
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x)[0]
    before = torch.get_float32_matmul_precision()
    errors = {}
    try:
        for setting in ("highest", "medium", "highest"):
            torch.set_float32_matmul_precision(setting)
            torch._dynamo.reset()
            with torch.no_grad():
                out = torch.compile(model, backend="kwker", options={"inner": inner})(x)[0]
            report = kd.last_report()
            assert {k[0] for k in report.kernels} >= {"linear_gelu", "linear_residual"}, report
            errors[setting] = ((out.double() - reference).abs().max()
                               / reference.abs().max()).item()
    finally:
        torch.set_float32_matmul_precision(before)
    assert errors["highest"] < 1e-5
    assert (errors["medium"] > 1e-4) == blocking.fast_bf16() and errors["medium"] < 1e-2
