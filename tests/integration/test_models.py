"""torch.compile(backend="kwker") against eager on the issue's models, in both inner modes.

Each test also checks which nodes became Kwker kernels: a model that silently ran on ATen or
Inductor would still match eager, so the kernel lists are part of the contract.
"""
import pytest
import torch

from .models import (
    Attention,
    GroupedQuery,
    OddSizes,
    Ranker,
    assert_close,
    assert_no_misses,
    compile_run,
    encoder_layer,
    kernels,
    mlp,
)

INNER = ["eager", "inductor"]


@pytest.fixture(scope="module")
def ranker():
    torch.manual_seed(0)
    return Ranker().eval()


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_ranker(ranker, inner, batch):
    x = torch.randn(batch, 64)
    (ref_v, ref_i), (v, i), reports = compile_run(ranker, (x,), inner)
    torch.testing.assert_close(v, ref_v, rtol=1e-4, atol=1e-5)
    assert (i == ref_i).float().mean().item() >= 0.99
    assert_no_misses(reports)
    assert kernels(reports) == ["linear", "linear_gelu", "linear_topk"]
    if inner == "eager":
        assert reports[-1].inner_nodes == []  # the whole model runs as three Kwker kernels


@pytest.mark.parametrize("inner", INNER)
def test_mlp(inner):
    torch.manual_seed(1)
    model, x = mlp().eval(), torch.randn(64, 1024)
    ref, out, reports = compile_run(model, (x,), inner)
    assert_close(out, ref)
    assert_no_misses(reports)
    assert kernels(reports) == ["linear", "linear_gelu"]


@pytest.mark.parametrize("inner", INNER)
def test_transformer_encoder_layer(inner):
    torch.manual_seed(2)
    model, x = encoder_layer().eval(), torch.randn(8, 128, 256)
    ref, out, reports = compile_run(model, (x,), inner)
    assert_close(out, ref)
    assert_no_misses(reports)
    # the fused native layer is split so its GEMMs and attention become kernels
    assert [op for _, op in reports[-1].decomposed] == ["_transformer_encoder_layer_fwd"]
    assert kernels(reports) == sorted(["linear", "sdpa", "linear_residual", "linear_gelu",
                                       "linear_residual", "layer_norm", "layer_norm"])
    if inner == "eager":  # attention reads q/k/v in place and writes ATen's output layout
        sdpa = [s for s in reports[-1].specs if type(s).__name__ == "AttentionSpec"]
        assert len(sdpa) == 1 and sdpa[0].strides, sdpa


@pytest.mark.parametrize("inner", INNER)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa(inner, causal):
    torch.manual_seed(3)
    q, k, v = (torch.randn(8, 8, 128, 32) for _ in range(3))
    ref, out, reports = compile_run(Attention(causal), (q, k, v), inner)
    assert_close(out, ref)
    assert_no_misses(reports)
    assert kernels(reports) == ["sdpa"]


@pytest.mark.parametrize("inner", INNER)
def test_odd_sizes(inner):
    torch.manual_seed(4)
    model = OddSizes().eval()
    x, seq = torch.randn(7, 13), torch.randn(3, 13, 7)
    mask = torch.randn(13, 13)
    ref, out, reports = compile_run(model, (x, seq, mask), inner)
    assert_close(out[:2], ref[:2])
    assert (out[2] == ref[2]).float().mean().item() >= 0.99
    assert_close(out[3:], ref[3:])
    assert_no_misses(reports)
    assert kernels(reports) == sorted([
        "linear_relu", "linear_gelu_tanh", "linear", "linear_residual", "linear_topk",
        "sdpa", "sdpa", "matmul", "gelu",
        "linear", "sdpa", "linear",  # nn.MultiheadAttention: in-projection, attention, out
    ])
    assert [op for _, op in reports[-1].decomposed] == ["multi_head_attention_forward"]


@pytest.mark.parametrize("inner", INNER)
def test_multihead_attention_sequence_first_causal(inner):
    """nn.MultiheadAttention with (L, N, E) inputs and a causal hint: attention is a kernel."""
    torch.manual_seed(5)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(64, 4)

        def forward(self, x):
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[0])
            return self.attn(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0]

    ref, out, reports = compile_run(Block().eval(), (torch.randn(10, 2, 64),), inner)
    assert_close(out, ref)
    assert_no_misses(reports)
    assert kernels(reports) == ["linear", "linear", "sdpa"]


@pytest.mark.parametrize("inner", INNER)
def test_large_erf_gelu_stays_on_aten(inner):
    """A standalone erf GELU becomes a kernel only up to GELU_ERF_MAX elements: above it ATen's
    vectorised erf is faster, and the report says so; the tanh form is always Kwker's."""
    from kwker.lowering.build import GELU_ERF_MAX

    class Acts(torch.nn.Module):
        def forward(self, small, big):
            return (torch.nn.functional.gelu(small), torch.nn.functional.gelu(big),
                    torch.nn.functional.gelu(big, approximate="tanh"))

    small, big = torch.randn(16, 1024), torch.randn(GELU_ERF_MAX // 512, 1024)
    ref, out, reports = compile_run(Acts(), (small, big), inner)
    assert_close(out, ref)
    assert kernels(reports) == ["gelu", "gelu"]  # the small erf one and the tanh one
    assert any("ATen's is faster" in why for r in reports for _, _, why in r.missed)


def test_inductor_custom_sdpa_reads_views_in_place():
    """Under inner="inductor" the attention custom op, called with sizes no compile built a
    kernel for, runs the generic kernel (which reads q, k, v views in place, heads side by
    side in one projection), and answers like ATen."""
    import torch.nn.functional as F

    from kwker.lowering.generic import generic_shapes
    import kwker.lowering.custom_ops as C

    C._cache.clear()  # kernels other tests built for these sizes would be found first
    torch.manual_seed(6)
    qkv = torch.randn(2, 40, 3, 4, 16).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    out = torch.ops.kwker.sdpa(q, k, v, None, True, None)
    assert out.is_contiguous()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-4, atol=1e-5)
    fn, _ = C.sdpa_kernel(q.shape, k.shape, v.shape, None, None, True, None,
                          (q.stride(), k.stride(), v.stride()), build=False)
    assert fn is None  # nothing specialised to these sizes...
    g = generic_shapes("sdpa", {"q": q.shape, "k": k.shape, "v": v.shape, "m": None})
    fn, _ = C.sdpa_kernel(g["q"], g["k"], g["v"], None, None, True, None, build=False)
    assert [(s.batch, s.lq, s.lk) for s in fn.kwker_specs] == [(0, 0, 0)]  # ...the generic


class ViewedHeads(torch.nn.Module):
    """BERT's self-attention: q, k and v projections, each viewed as heads (strided, the heads
    side by side in each row)."""

    def __init__(self, d=96, heads=4):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        self.heads = heads

    def forward(self, x):
        b, length, d = x.shape

        def split(t):
            return t.view(b, length, self.heads, d // self.heads).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(x)), split(self.v(x)))


def test_inductor_prebuilds_attention_for_the_layout_it_is_called_with():
    """Under inner="inductor" the attention kernel built at compile time is the one for the
    strides q, k and v arrive in (heads side by side): the calls find it, and no generic kernel
    (slower, sizes read per call) is built behind it."""
    import kwker.lowering.custom_ops as C
    from kwker.lowering.generic import generic_shapes

    torch.manual_seed(7)
    b, length, d, h = 2, 40, 96, 4
    ref, out, reports = compile_run(ViewedHeads(d, h).eval(), (torch.randn(b, length, d),),
                                    "inductor")
    assert_close(out, ref)
    assert kernels(reports) == ["linear", "linear", "linear", "sdpa"]
    shape, strides = (b, h, length, d // h), (length * d, d // h, d, 1)
    fn, _ = C.sdpa_kernel(shape, shape, shape, None, None, False, None, (strides,) * 3,
                          build=False)
    assert fn is not None and fn.kwker_specs[0].lq == length
    g = generic_shapes("sdpa", {"q": shape, "k": shape, "v": shape, "m": None})
    fn, _ = C.sdpa_kernel(g["q"], g["k"], g["v"], None, None, False, None, build=False)
    assert fn is None


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("repeat", ["flag", "expand", "interleave"])
def test_grouped_query_attention(repeat, inner):
    """enable_gqa=True and the repeat-kv spellings run as one attention kernel on the unrepeated
    k/v heads (the repeats are not executed)."""
    torch.manual_seed(11)
    model = GroupedQuery(repeat=repeat).eval()
    ref, out, reports = compile_run(model, (torch.randn(2, 37, 256),), inner)
    assert_close(out, ref)
    assert_no_misses(reports)
    assert kernels(reports) == ["linear", "linear", "linear", "sdpa"]
    sdpa = next(k[1] for k in reports[-1].kernels if k[0] == "sdpa")
    assert len(sdpa) == (1 if repeat == "flag" else 3 if repeat == "interleave" else 7), sdpa


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_stacked_encoder_layers_all_lowered(inner):
    """nn.TransformerEncoder runs its layers as fused ops one after another: each is expanded,
    the second reading the first's expansion."""
    torch.manual_seed(12)
    model = torch.nn.TransformerEncoder(encoder_layer(), 3).eval()
    with torch.no_grad():
        ref, out, reports = compile_run(model, (torch.randn(2, 40, 256),), inner)
    assert_close(out, ref)
    assert_no_misses(reports)
    assert kernels(reports) == sorted(["linear", "linear_gelu", "linear_residual",
                                       "linear_residual", "sdpa", "layer_norm",
                                       "layer_norm"] * 3)
