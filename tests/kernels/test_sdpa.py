"""make_sdpa against torch's scaled_dot_product_attention: shapes, causal, masks, scale."""
import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.sdpa import make_sdpa

TOL = dict(rtol=1e-4, atol=1e-5)


def run(b, h, lq, lk, e, ev, causal=False, scale=None, mask=None, mask_shape=None, seed=0):
    torch.manual_seed(seed)
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, h, lk, e), torch.randn(b, h, lk, ev)
    am = None
    if mask == "bool":
        am = torch.rand(mask_shape) > 0.3
    elif mask == "float":
        am = torch.randn(mask_shape)
    f = make_sdpa(b, h, lq, lk, e, ev, causal, scale, mask, mask_shape)
    return f(q, k, v, am), (q, k, v, am)


@pytest.mark.parametrize("shape", [(1, 1, 5, 7, 3, 3), (2, 3, 37, 53, 16, 16),
                                   (1, 2, 130, 300, 32, 32), (1, 1, 1, 129, 64, 64),
                                   (3, 2, 25, 1, 8, 8), (1, 2, 49, 49, 24, 40)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_shapes(shape, causal, threads):
    y, (q, k, v, _) = run(*shape, causal=causal)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               **TOL)


def test_sdpa_causal_more_queries_than_keys():
    y, (q, k, v, _) = run(1, 2, 300, 130, 64, 64, causal=True, seed=2)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


def test_sdpa_custom_scale():
    y, (q, k, v, _) = run(2, 2, 40, 70, 32, 32, scale=0.3, seed=3)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, scale=0.3), **TOL)


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(2, 2, 33, 65), (2, 1, 33, 65), (1, 2, 1, 65),
                                        (2, 2, 33, 1), (1, 1, 33, 65)])
def test_sdpa_masks(mask, mask_shape, threads):
    y, (q, k, v, am) = run(2, 2, 33, 65, 24, 40, mask=mask, mask_shape=mask_shape, seed=4)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, attn_mask=am), **TOL)


def test_sdpa_fully_masked_rows_give_zero():
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 9, 8), torch.randn(1, 1, 9, 8)
    am = torch.ones(1, 1, 6, 9, dtype=torch.bool)
    am[0, 0, 2] = False
    fm = torch.zeros(1, 1, 6, 9)
    fm[0, 0, 4] = -float("inf")
    for mask, m in (("bool", am), ("float", fm)):
        y = make_sdpa(1, 1, 6, 9, 8, 8, False, None, mask, tuple(m.shape))(q, k, v, m)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        torch.testing.assert_close(y, ref, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq", [3, 130])  # the few-query path and the blocked one
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_nan_scores_give_nan_rows_as_aten(dtype, lq, causal):
    """A NaN score makes its row NaN, as in ATen; a causal row that cannot see the NaN key
    stays finite (the kernel flushes tiny probabilities to 0, never a NaN to anything)."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(2, 3, n, 32).to(dtype) for n in (lq, 140, 140))
    q[0, 1, 1, 4] = float("nan")    # one query row
    k[1, 2, 2, 7] = float("nan")    # one key: every row that sees it
    y = make_sdpa(2, 3, lq, 140, 32, 32, causal, dtype=dtype)(q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.equal(y.isnan(), ref.isnan()) and ref.isnan().any()
    tol = TOL if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, ref, equal_nan=True, **tol)


def test_sdpa_large_values_are_stable():
    """Online softmax: scores far apart in magnitude across key blocks (max moves late)."""
    torch.manual_seed(6)
    q, k, v = torch.randn(1, 1, 20, 16) * 8, torch.randn(1, 1, 600, 16), torch.randn(1, 1, 600, 16)
    k[..., 500:, :] *= 6
    y = make_sdpa(1, 1, 20, 600, 16, 16)(q, k, v)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v), **TOL)


def test_sdpa_rejects_wrong_inputs():
    f = make_sdpa(1, 1, 4, 4, 8, 8, mask="bool")
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError):
        f(q, q, q)  # mask missing
    with pytest.raises(NotImplementedError):
        f(q, q, q, torch.zeros(1, 1, 4, 4))  # float mask for a bool kernel
    with pytest.raises(ValueError):
        make_sdpa(1, 1, 4, 4, 8, 8, mask="bool", mask_shape=(1, 1, 3, 4))


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_sdpa_decode_with_mask(mask, threads):
    """Few queries take the unpacked dot-product path for the scores."""
    y, (q, k, v, am) = run(2, 3, 3, 70, 40, 24, mask=mask, mask_shape=(2, 1, 3, 70), seed=8)
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, attn_mask=am), **TOL)


@pytest.mark.parametrize("lq", [3, 37, 130])  # decode path (a few queries) and blocked path
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_strided_in_place(lq, causal, threads):
    """q, k, v as the head views of one packed (B, L, 3, H, E) projection, and the output in
    ATen's (B, L, H, E) memory order: read and written in place, no copies, same result."""
    torch.manual_seed(3)
    b, h, e = 2, 3, 16
    qkv = torch.randn(b, lq, 3, h, e).permute(2, 0, 3, 1, 4)  # (3, B, H, L, E) views
    q, k, v = qkv[0], qkv[1], qkv[2]
    out_strides = (lq * h * e, e, h * e, 1)
    f = make_sdpa(b, h, lq, lq, e, e, causal, strides=(q.stride(), k.stride(), v.stride(),
                                                       out_strides))
    assert f.spec.strides  # a layout of its own, not the contiguous kernel
    y = f(q, k, v)
    assert y.stride() == out_strides
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               **TOL)
    # contiguous inputs to the strided kernel are copied into its layout, not misread
    torch.testing.assert_close(f(q.contiguous(), k.contiguous(), v.contiguous()), y, **TOL)


@pytest.mark.parametrize("shape,kvh", [((2, 8, 37, 53, 16, 16), 2), ((1, 4, 130, 300, 32, 32), 1),
                                       ((2, 6, 1, 70, 40, 24), 3), ((1, 4, 49, 49, 17, 40), 2),
                                       ((2, 4, 3, 37, 17, 17), 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_gqa(shape, kvh, causal, threads):
    """Grouped-query attention: query head h reads kv head h // (heads // kv_heads)."""
    torch.manual_seed(9)
    b, h, lq, lk, e, ev = shape
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, kvh, lk, e), torch.randn(b, kvh, lk, ev)
    f = make_sdpa(*shape, causal, kv_heads=kvh)
    assert f.spec.kv_heads == (0 if kvh == h else kvh)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.testing.assert_close(f(q, k, v), ref, **TOL)


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_sdpa_gqa_mask(mask):
    torch.manual_seed(10)
    q, k, v = torch.randn(2, 6, 33, 24), torch.randn(2, 2, 65, 24), torch.randn(2, 2, 65, 40)
    am = torch.rand(2, 6, 33, 65) > 0.3 if mask == "bool" else torch.randn(1, 6, 1, 65)
    y = make_sdpa(2, 6, 33, 65, 24, 40, mask=mask, mask_shape=tuple(am.shape), kv_heads=2)(
        q, k, v, am)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=am, enable_gqa=True)
    torch.testing.assert_close(y, ref, **TOL)


@pytest.mark.parametrize("lq", [2, 37])
def test_sdpa_gqa_strided_in_place(lq, threads):
    """q, k, v as head views of one fused (B, L, H + 2 * KVH, E) projection (as GQA models
    make them): the kv head mapping goes through the strides, nothing is copied."""
    torch.manual_seed(11)
    b, h, kvh, e = 2, 6, 2, 16
    proj = torch.randn(b, lq, h + 2 * kvh, e).transpose(1, 2)  # (B, heads, L, E) view
    q, k, v = proj[:, :h], proj[:, h:h + kvh], proj[:, h + kvh:]
    f = make_sdpa(b, h, lq, lq, e, e, True, kv_heads=kvh,
                  strides=(q.stride(), k.stride(), v.stride(), (lq * h * e, e, h * e, 1)))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(f(q, k, v), ref, **TOL)


def test_sdpa_gqa_rejects_bad_head_counts():
    with pytest.raises(ValueError):
        make_sdpa(1, 6, 4, 4, 8, 8, kv_heads=4)
    f = make_sdpa(1, 4, 4, 4, 8, 8, kv_heads=2)
    q, k = torch.randn(1, 4, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError):
        f(q, q, q)  # k/v with the query's head count
    torch.testing.assert_close(f(q, k, k), F.scaled_dot_product_attention(q, k, k,
                                                                          enable_gqa=True), **TOL)
