"""The generic attention kernel (make_sdpa with batch/lq/lk None) against ATen's SDPA.

One kernel per (heads, e, ev, flags, dtype) serves every batch, query and key length and
layout: each test below runs many sizes through one callable. Outputs must match
``F.scaled_dot_product_attention`` in value (float32: test_sdpa.py's tolerance; bf16: the error
bound of test_sdpa_bf16.py) and in layout (strides), and no size may trigger a compile.
"""
import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.sdpa import make_sdpa
from kwker.kernels.specs import AttentionSpec
from kwker.runtime import kernel

from .test_sdpa_bf16 import check as check_bf16

TOL = {"rtol": 1e-4, "atol": 1e-5}
BF = torch.bfloat16
# (batch, lq, lk): 1s, primes, lq != lk both ways, past a query block (24) and key blocks (256),
# decode against a long cache
SIZES = [(1, 1, 1), (2, 1, 7), (1, 5, 1), (3, 2, 3), (1, 4, 4), (2, 5, 5), (1, 13, 7),
         (2, 37, 53), (1, 53, 37), (3, 24, 24), (1, 25, 300), (2, 300, 131), (1, 1, 300),
         (2, 1, 2999)]


@pytest.fixture
def no_compiles(monkeypatch):
    """Fails the test if any kernel is built or loaded while it runs (after ``arm()``)."""
    calls = []
    real = kernel.object_for

    def counting(spec, target):
        calls.append(spec)
        return real(spec, target)

    class Counter:
        def arm(self):
            monkeypatch.setattr(kernel, "object_for", counting)

        def check(self):
            assert not calls, f"compiled or loaded {[s.symbol for s in calls]}"

    c = Counter()
    yield c
    c.check()


def reference(q, k, v, am=None, **kw):
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=am, **kw, **gqa)


def same(y, ref, tol=TOL):
    torch.testing.assert_close(y, ref, **tol)
    assert y.stride() == ref.stride(), (y.stride(), ref.stride())


def qkv(b, h, lq, lk, e, ev, kvh=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    kvh = kvh or h
    return (torch.randn(b, h, lq, e, generator=g).to(dtype),
            torch.randn(b, kvh, lk, e, generator=g).to(dtype),
            torch.randn(b, kvh, lk, ev, generator=g).to(dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_generic_sizes(causal, threads, no_compiles):
    f = make_sdpa(None, 3, None, None, 16, 16, causal)
    assert (f.spec.batch, f.spec.lq, f.spec.lk, f.spec.strides) == (0, 0, 0, ())
    no_compiles.arm()
    for i, (b, lq, lk) in enumerate(SIZES):
        q, k, v = qkv(b, 3, lq, lk, 16, 16, seed=i)
        same(f(q, k, v), reference(q, k, v, is_causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_generic_unequal_head_sizes_and_scale(causal, no_compiles):
    """e != ev (ATen's math path: contiguous output) and a custom scale."""
    f = make_sdpa(None, 2, None, None, 24, 40, causal, scale=0.3)
    no_compiles.arm()
    for i, (b, lq, lk) in enumerate(SIZES):
        q, k, v = qkv(b, 2, lq, lk, 24, 40, seed=i)
        same(f(q, k, v), reference(q, k, v, is_causal=causal, scale=0.3))


def test_generic_large_values_are_stable():
    """Online softmax across key blocks: the running max moves late."""
    f = make_sdpa(None, 1, None, None, 16, 16)
    for lq in (3, 20):
        q, k, v = qkv(1, 1, lq, 600, 16, 16, seed=6)
        q, k[..., 500:, :] = q * 8, k[..., 500:, :] * 6
        same(f(q, k, v), reference(q, k, v))


MASK_SHAPES = [(0, 0, 0, 0), (0, 1, 0, 0), (1, 0, 1, 0), (0, 0, 0, 1), (1, 1, 0, 0)]


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES)
def test_generic_masks(kind, mask_shape, threads, no_compiles):
    """Masks broadcast as built (1 = broadcast dim), at many sizes; 2-D masks too."""
    f = make_sdpa(None, 2, None, None, 24, 40, mask=kind, mask_shape=mask_shape)
    no_compiles.arm()
    g = torch.Generator().manual_seed(4)
    for i, (b, lq, lk) in enumerate(SIZES):
        q, k, v = qkv(b, 2, lq, lk, 24, 40, seed=i)
        shape = tuple(1 if m else n for m, n in zip(mask_shape, (b, 2, lq, lk)))
        am = torch.rand(shape, generator=g) > 0.3 if kind == "bool" else \
            torch.randn(shape, generator=g)
        same(f(q, k, v, am), reference(q, k, v, am))
        if mask_shape[:2] == (1, 1):
            same(f(q, k, v, am[0, 0]), reference(q, k, v, am[0, 0]))


def test_generic_mask_layouts():
    """A full-size kernel takes masks broadcast at call time (size 1 or stride 0, the key dim
    too) and masks whose key dim is not contiguous."""
    f = make_sdpa(None, 2, None, None, 16, 16, mask="float")
    q, k, v = qkv(2, 2, 9, 21, 16, 16, seed=3)
    g = torch.Generator().manual_seed(3)
    masks = [torch.randn(shape, generator=g) for shape in
             [(1, 1, 9, 21), (2, 1, 1, 21), (1, 2, 9, 1), (1, 21), (9, 1)]]
    masks += [torch.randn(2, 2, 21, 9, generator=g).transpose(-1, -2),
              torch.randn(9, 21, generator=g).expand(2, 2, 9, 21),
              torch.randn(2, 1, 9, 1, generator=g).expand(2, 2, 9, 21)]
    for am in masks:
        same(f(q, k, v, am), reference(q, k, v, am))


def test_generic_fully_masked_rows():
    """Rows with no visible key give what ATen gives (zeros), bool and float masks."""
    q, k, v = qkv(1, 1, 6, 9, 8, 8, seed=5)
    am = torch.ones(1, 1, 6, 9, dtype=torch.bool)
    am[0, 0, 2] = False
    fm = torch.zeros(6, 9)
    fm[4] = -float("inf")
    for kind, m in (("bool", am), ("float", fm)):
        y = make_sdpa(None, 1, None, None, 8, 8, mask=kind)(q, k, v, m)
        assert torch.all(y[0, 0, 2 if kind == "bool" else 4] == 0)
        same(y, reference(q, k, v, m))


@pytest.mark.parametrize("kvh", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_generic_gqa(kvh, causal, threads, no_compiles):
    f = make_sdpa(None, 4, None, None, 17, 17, causal, kv_heads=kvh)
    assert f.spec.kv_heads == kvh
    no_compiles.arm()
    for i, (b, lq, lk) in enumerate(SIZES):
        q, k, v = qkv(b, 4, lq, lk, 17, 17, kvh=kvh, seed=i)
        same(f(q, k, v), reference(q, k, v, is_causal=causal))


@pytest.mark.parametrize("causal", [False, True])
def test_generic_strided_views(causal, threads, no_compiles):
    """q, k, v as head views of packed projections (read in place, whatever the strides):
    (B, L, 3, H, E) as TransformerEncoderLayer makes them, (L, B, H * E) chunks as
    MultiheadAttention makes them, and q with its head dim not innermost (copied). The output
    takes ATen's layout each time."""
    f = make_sdpa(None, 3, None, None, 16, 16, causal)
    no_compiles.arm()
    for b, lq in [(2, 1), (2, 3), (2, 37), (1, 130), (3, 5)]:
        g = torch.Generator().manual_seed(lq)
        q, k, v = torch.randn(b, lq, 3, 3, 16, generator=g).permute(2, 0, 3, 1, 4)
        same(f(q, k, v), reference(q, k, v, is_causal=causal))
        x = torch.randn(lq, b, 3 * 48, generator=g)
        q, k, v = (t.reshape(lq, b * 3, 16).transpose(0, 1).view(b, 3, lq, 16)
                   for t in x.chunk(3, -1))
        same(f(q, k, v), reference(q, k, v, is_causal=causal))
        qt = torch.randn(b, 3, 16, lq, generator=g).transpose(-1, -2)
        same(f(qt, k, v), reference(qt, k, v, is_causal=causal))


def test_generic_gqa_strided_views():
    """GQA heads as views of one fused (B, L, H + 2 KVH, E) projection."""
    f = make_sdpa(None, 6, None, None, 16, 16, True, kv_heads=2)
    for lq in (2, 37):
        proj = torch.randn(2, lq, 10, 16).transpose(1, 2)
        q, k, v = proj[:, :6], proj[:, 6:8], proj[:, 8:]
        same(f(q, k, v), reference(q, k, v, is_causal=True))


@pytest.mark.parametrize("dtype", [torch.float32, BF])
def test_generic_decode_loop(dtype, threads, no_compiles):
    """Token by token: one query against a KV cache growing from 1 to 70 keys, read in place
    as views of the preallocated cache; no compile along the way."""
    h, e, steps = 6, 64, 70
    f = make_sdpa(None, h, None, None, e, e, dtype=dtype)
    no_compiles.arm()
    g = torch.Generator().manual_seed(7)
    cache_k = torch.randn(2, h, steps, e, generator=g).to(dtype)
    cache_v = torch.randn(2, h, steps, e, generator=g).to(dtype)
    for n in range(1, steps + 1):
        q = torch.randn(2, h, 1, e, generator=g).to(dtype)
        k, v = cache_k[:, :, :n], cache_v[:, :, :n]
        y = f(q, k, v)
        if dtype == BF:
            check_bf16(y, q, k, v)
            assert y.stride() == reference(q, k, v).stride()
        else:
            same(y, reference(q, k, v))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("e,ev", [(16, 16), (17, 17), (24, 40)])
def test_generic_bf16(e, ev, causal, threads, no_compiles):
    f = make_sdpa(None, 2, None, None, e, ev, causal, dtype=BF)
    no_compiles.arm()
    for i, (b, lq, lk) in enumerate(SIZES + [(1, 2, 517)]):
        q, k, v = qkv(b, 2, lq, lk, e, ev, dtype=BF, seed=i)
        y = f(q, k, v)
        check_bf16(y, q, k, v, is_causal=causal)
        assert y.stride() == reference(q, k, v, is_causal=causal).stride()


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_generic_bf16_mask_gqa_strided(kind):
    f = make_sdpa(None, 4, None, None, 24, 24, mask=kind, mask_shape=(0, 1, 0, 0), dtype=BF,
                  kv_heads=2)
    g = torch.Generator().manual_seed(12)
    for b, lq, lk in [(2, 33, 65), (1, 1, 70), (2, 3, 5), (1, 130, 300)]:
        proj = torch.randn(b, max(lq, lk), 8, 24, generator=g).to(BF).transpose(1, 2)
        q, k, v = proj[:, :4, :lq], proj[:, 4:6, :lk], proj[:, 6:, :lk]
        am = torch.rand(b, 1, lq, lk, generator=g) > 0.3 if kind == "bool" else \
            torch.randn(b, 1, lq, lk, generator=g).to(BF)
        check_bf16(f(q, k, v, am), q, k, v, am)


def test_generic_empty_sizes():
    f = make_sdpa(None, 2, None, None, 8, 8)
    for b, lq, lk in [(0, 3, 4), (1, 0, 4), (1, 3, 0)]:
        q, k, v = qkv(b, 2, lq, lk, 8, 8)
        same(f(q, k, v), reference(q, k, v))


def test_generic_one_kernel_per_config():
    """Sizes are not part of the spec: the same (heads, e, ev, flags, dtype) is one kernel."""
    a = make_sdpa(None, 4, None, None, 32, 32, True, dtype=BF)
    b = make_sdpa(None, 4, 7, None, 32, 32, True, dtype=BF)  # any size None: all at run time
    assert a.spec == b.spec and "bf16" in a.spec.symbol
    assert make_sdpa(None, 4, None, None, 32, 32, False).spec != a.spec


def test_generic_rejects_wrong_inputs():
    f = make_sdpa(None, 2, None, None, 8, 8, mask="bool", mask_shape=(1, 1, 0, 0))
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError):
        f(q, q, q)  # mask missing
    with pytest.raises(NotImplementedError):
        f(q, q, q, torch.zeros(4, 4))  # float mask for a bool kernel
    with pytest.raises(ValueError):
        f(q, q, q, torch.ones(1, 2, 4, 4, dtype=torch.bool))  # heads built as broadcast
    with pytest.raises(ValueError):
        f(q, q, q, torch.ones(4, 3, dtype=torch.bool))  # does not broadcast
    g = make_sdpa(None, 2, None, None, 8, 8)
    with pytest.raises(NotImplementedError):
        g(q.to(BF), q, q)
    with pytest.raises(ValueError):
        g(torch.randn(1, 3, 4, 8), q, q)  # 3 heads for a 2-head kernel
    with pytest.raises(ValueError):
        g(q, q, torch.randn(1, 2, 5, 8))  # k and v lengths differ
    with pytest.raises(ValueError):
        make_sdpa(None, 2, None, None, 8, 8, mask="bool", mask_shape=(1, 1, 4, 4))
    with pytest.raises(ValueError):
        make_sdpa(None, 2, 4, 4, 8, 8, strides=((64, 32, 8, 1),) * 4)
    with pytest.raises(ValueError):
        AttentionSpec(0, 2, 4, 0, 8, 8)  # generic is all of batch, lq, lk or none
