"""make_sdpa in bfloat16 and with grouped-query attention, against real references.

bf16 contract: the inputs (bf16) are upcast and run through ATen's SDPA in float32; Kwker's max
abs error against that reference must be within 1.25x eager bf16 SDPA's own max abs error, plus
1e-3 * max|reference|. The same checks run on the AVX2 and AVX-512-without-BF16 code paths in a
subprocess whose target is overridden (this file is its worker: ``python test_sdpa_bf16.py``).

On a CPU with AVX512_BF16 the tests in this process run the vdpbf16ps kernel (P rounded to bf16
as ATen's flash kernel rounds it, when e == ev); the assembly checks below hold anywhere.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.sdpa import make_sdpa

BF = torch.bfloat16


def inputs(b, h, lq, lk, e, ev, kvh=None, mask=None, mask_shape=None, seed=0):
    """bf16 q, k, v (k/v with ``kvh`` heads) and mask (bool, or float in bf16)."""
    g = torch.Generator().manual_seed(seed)
    kvh = kvh or h
    q = torch.randn(b, h, lq, e, generator=g).to(BF)
    k = torch.randn(b, kvh, lk, e, generator=g).to(BF)
    v = torch.randn(b, kvh, lk, ev, generator=g).to(BF)
    am = None
    if mask == "bool":
        am = torch.rand(mask_shape, generator=g) > 0.3
    elif mask == "float":
        am = torch.randn(mask_shape, generator=g).to(BF)
    return q, k, v, am


def errors(y, q, k, v, am=None, **kw):
    """(Kwker's, eager bf16's) max abs error vs float32 ATen on the upcast inputs, max|ref|."""
    gqa = dict(enable_gqa=True) if k.shape[1] != q.shape[1] else {}
    up = [t.float() for t in (q, k, v)]
    am32 = am.float() if am is not None and am.dtype == BF else am
    ref = F.scaled_dot_product_attention(*up, attn_mask=am32, **kw, **gqa)
    eager = F.scaled_dot_product_attention(q, k, v, attn_mask=am, **kw, **gqa)
    assert y.dtype == BF and y.shape == ref.shape
    return ((y.float() - ref).abs().max().item(), (eager.float() - ref).abs().max().item(),
            ref.abs().max().item())


def check(y, q, k, v, am=None, **kw):
    ours, eager, top = errors(y, q, k, v, am, **kw)
    assert ours <= 1.25 * eager + 1e-3 * top, (ours, eager, top)


def run(shape, causal=False, scale=None, mask=None, mask_shape=None, kvh=None, seed=0):
    q, k, v, am = inputs(*shape, kvh=kvh, mask=mask, mask_shape=mask_shape, seed=seed)
    f = make_sdpa(*shape, causal, scale, mask, mask_shape, dtype=BF, kv_heads=kvh)
    check(f(q, k, v, am), q, k, v, am, is_causal=causal, scale=scale)


SHAPES = [(1, 1, 5, 7, 3, 3), (2, 3, 37, 53, 16, 16), (1, 2, 130, 300, 32, 32),
          (2, 2, 70, 90, 17, 17), (1, 1, 1, 37, 17, 17), (2, 3, 3, 70, 40, 24),
          (1, 2, 49, 49, 24, 40), (1, 2, 300, 130, 64, 64), (3, 2, 25, 1, 8, 8)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_shapes(shape, causal, threads):
    run(shape, causal)


def test_bf16_scale():
    run((2, 2, 40, 70, 32, 32), scale=0.3, seed=3)
    run((1, 2, 2, 70, 17, 17), scale=0.3, seed=3)


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", [(2, 2, 33, 65), (2, 1, 33, 65), (1, 2, 1, 65),
                                        (2, 2, 33, 1), (1, 1, 33, 65)])
def test_bf16_masks(mask, mask_shape, threads):
    run((2, 2, 33, 65, 24, 40), mask=mask, mask_shape=mask_shape, seed=4)


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize("lq", [1, 3])
def test_bf16_decode_with_mask(mask, lq):
    run((2, 3, lq, 37, 17, 17), mask=mask, mask_shape=(2, 1, lq, 37), seed=8)


def test_bf16_fully_masked_rows_give_zero():
    q, k, v, _ = inputs(1, 1, 6, 9, 8, 8, seed=5)
    am = torch.ones(1, 1, 6, 9, dtype=torch.bool)
    am[0, 0, 2] = False
    fm = torch.zeros(1, 1, 6, 9, dtype=BF)
    fm[0, 0, 4] = -float("inf")
    for mask, m in (("bool", am), ("float", fm)):
        y = make_sdpa(1, 1, 6, 9, 8, 8, False, None, mask, tuple(m.shape), dtype=BF)(q, k, v, m)
        row = 2 if mask == "bool" else 4
        assert torch.all(y[0, 0, row] == 0)
        keep = [i for i in range(6) if i != row]
        check(y[:, :, keep], q[:, :, keep], k, v, m[:, :, keep])


def test_bf16_large_values_are_stable():
    """Online softmax: the running max moves late, in a later key block."""
    q, k, v, _ = inputs(1, 1, 20, 600, 16, 16, seed=6)
    q = (q.float() * 8).to(BF)
    k[..., 500:, :] = (k[..., 500:, :].float() * 6).to(BF)
    check(make_sdpa(1, 1, 20, 600, 16, 16, dtype=BF)(q, k, v), q, k, v)


def test_bf16_output_is_one_rounding():
    """With one visible key per row (causal, lq = 1) the output is V's row itself, exactly."""
    q, k, v, _ = inputs(1, 2, 1, 37, 17, 17, seed=9)
    y = make_sdpa(1, 2, 1, 37, 17, 17, True, dtype=BF)(q, k, v)
    assert torch.equal(y, v[:, :, :1])


@pytest.mark.parametrize("lq", [3, 37, 130])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_strided_in_place(lq, causal, threads):
    """q, k, v as head views of one packed (B, L, 3, H, E) bf16 projection, the output in
    ATen's (B, L, H, E) order: read and written in place."""
    g = torch.Generator().manual_seed(3)
    b, h, e = 2, 3, 17
    qkv = torch.randn(b, lq, 3, h, e, generator=g).to(BF).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    out_strides = (lq * h * e, e, h * e, 1)
    f = make_sdpa(b, h, lq, lq, e, e, causal, dtype=BF,
                  strides=(q.stride(), k.stride(), v.stride(), out_strides))
    assert f.spec.strides and f.spec.dtype == "bf16"
    y = f(q, k, v)
    assert y.stride() == out_strides
    check(y, q, k, v, is_causal=causal)
    assert torch.equal(f(q.contiguous(), k.contiguous(), v.contiguous()), y)


@pytest.mark.parametrize("shape,kvh", [((2, 8, 37, 53, 16, 16), 2), ((1, 4, 130, 300, 32, 32), 1),
                                       ((2, 6, 1, 37, 17, 17), 3), ((1, 4, 49, 49, 24, 40), 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_gqa(shape, kvh, causal, threads):
    run(shape, causal, kvh=kvh, seed=11)


@pytest.mark.parametrize("lq", [2, 37])
def test_bf16_gqa_strided_in_place(lq):
    """q, k, v as head views of one fused (B, L, H + 2 * KVH, E) bf16 projection."""
    g = torch.Generator().manual_seed(13)
    b, h, kvh, e = 2, 6, 2, 17
    proj = torch.randn(b, lq, h + 2 * kvh, e, generator=g).to(BF).transpose(1, 2)
    q, k, v = proj[:, :h], proj[:, h:h + kvh], proj[:, h + kvh:]
    f = make_sdpa(b, h, lq, lq, e, e, True, kv_heads=kvh, dtype=BF,
                  strides=(q.stride(), k.stride(), v.stride(), (lq * h * e, e, h * e, 1)))
    check(f(q, k, v), q, k, v, is_causal=True)


def test_bf16_gqa_mask():
    run((2, 4, 33, 65, 24, 40), kvh=2, mask="float", mask_shape=(2, 4, 33, 65), seed=12)
    run((2, 4, 33, 65, 24, 40), kvh=2, mask="bool", mask_shape=(1, 4, 1, 65), seed=12)


# edges of the bf16 pairs (vdpbf16ps path): odd e (a zero high half in Q and K), e past one
# vector of pairs (33: 17 pairs; 128: 4 blocks of K words), odd key counts in the last key block
# (517 = 256 + 256 + 5), a query block tail, causal diagonals crossing key blocks
PAIR_EDGES = [(1, 2, 45, 517, 33, 33), (2, 1, 30, 64, 128, 128), (1, 3, 61, 259, 64, 64),
              (2, 2, 26, 27, 2, 2), (1, 2, 300, 300, 1, 1)]


@pytest.mark.parametrize("shape", PAIR_EDGES)
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_pair_edges(shape, causal, threads):
    run(shape, causal, seed=22)


def test_bf16_transformer_shape():
    """TransformerEncoderLayer's attention (8 heads of 32, 128 tokens), in place."""
    g = torch.Generator().manual_seed(17)
    b, h, lq, e = 8, 8, 128, 32
    qkv = torch.randn(b, lq, 3, h, e, generator=g).to(BF).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    f = make_sdpa(b, h, lq, lq, e, e, dtype=BF,
                  strides=(q.stride(), k.stride(), v.stride(), (lq * h * e, e, h * e, 1)))
    check(f(q, k, v), q, k, v)
    run((8, 8, 128, 128, 32, 32), True, seed=17)


def _sdpa_asm(spec_args, features):
    from kwker.kernels.specs import AttentionSpec
    from kwker.kernels.sdpa import _blocking
    from kwker.runtime.compiler import compile_assembly
    from kwker.runtime.kernel import ir_text
    from kwker.runtime.target import make_target
    target = make_target("znver4", features)
    b, h, lq, lk, e, ev, causal = spec_args
    spec = AttentionSpec(b, h, lq, lk, e, ev, causal, 0.0, "none", (),
                         **_blocking(lq, lk, e, ev), dtype="bf16")
    text = ir_text(spec, target)
    return text, compile_assembly(text, target)[1]


AVX512_FEATURES = "+avx,+avx2,+fma,+f16c,+bmi2,+avx512f,+avx512bw,+avx512vl,+avx512dq"


@pytest.mark.parametrize("args", [(2, 4, 100, 100, 32, 32, True), (1, 2, 300, 517, 17, 17, False),
                                  (2, 3, 1, 70, 64, 64, False)])
def test_bf16_avx512bf16_build_uses_vdpbf16ps(args):
    """Both products on vdpbf16ps (S = Q K^T, then O += P V on bf16 P), the probabilities rounded
    with vcvtneps2bf16; the decode path (lq = 1) still takes P V there."""
    ir_text, asm = _sdpa_asm(args, AVX512_FEATURES + ",+avx512bf16")
    assert re.search(r"vdpbf16ps\s+[^\n]*%zmm", asm)
    assert re.search(r"vcvtneps2bf16\s+%zmm", asm)
    kernels = set(re.findall(r'define internal void @"(uk\.[^"]*\.dpbf16[^"]*)"', ir_text))
    assert len(kernels) >= (1 if args[2] == 1 else 2), kernels  # O tiles; S tiles past decode


def test_bf16_unequal_head_sizes_keep_float32_p():
    """e != ev: ATen computes those in float32, so P stays float32 (FMAs on widened V) and only
    S = Q K^T takes vdpbf16ps."""
    ir_text, asm = _sdpa_asm((1, 2, 49, 49, 24, 40, False), AVX512_FEATURES + ",+avx512bf16")
    assert re.search(r"vdpbf16ps\s+[^\n]*%zmm", asm)
    tiles = set(re.findall(r'define internal void @"(uk\.[^"]*)"', ir_text))
    assert any(".dpbf16" not in t for t in tiles), tiles  # O += P V: float32 P, FMAs
    assert re.search(r"vfmadd\d{3}ps\s+[^\n]*%zmm", asm)


def test_bf16_avx512_without_bf16_build_widens():
    _, asm = _sdpa_asm((2, 4, 100, 100, 32, 32, True), AVX512_FEATURES + ",-avx512bf16")
    assert "vdpbf16ps" not in asm and "vcvtneps2bf16" not in asm
    assert re.search(r"vfmadd\d{3}ps\s+[^\n]*%zmm", asm)


def test_bf16_rejects_wrong_inputs():
    f = make_sdpa(1, 1, 4, 4, 8, 8, mask="float", dtype=BF)
    q = torch.randn(1, 1, 4, 8).to(BF)
    with pytest.raises(NotImplementedError):
        f(q.float(), q, q, torch.zeros(1, 1, 4, 4, dtype=BF))  # float32 q for a bf16 kernel
    with pytest.raises(NotImplementedError):
        f(q, q, q, torch.zeros(1, 1, 4, 4))  # float32 mask: ATen wants the q dtype too
    with pytest.raises(NotImplementedError):
        make_sdpa(1, 1, 4, 4, 8, 8, dtype=torch.float16)


# -- other ISAs on this machine, in a subprocess with an overridden target -----------------------
ISAS = {
    "avx2": ("znver3", "+avx,+avx2,+fma,+f16c,+bmi2,-avx512f,-avx512bw,-avx512vl,-avx512dq,"
                       "-avx512bf16", "AVX2"),
    "avx512-nobf16": ("skylake-avx512", "+avx,+avx2,+fma,+f16c,+bmi2,+avx512f,+avx512bw,"
                                        "+avx512vl,+avx512dq,-avx512bf16", "AVX-512"),
}


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_bf16_and_gqa_on_other_isa(isa, tmp_path):
    from kwker.runtime.target import host_target
    cpu, features, name = ISAS[isa]
    if not host_target().has("avx512f" if "512" in isa else "avx2"):
        pytest.skip(f"host cannot run {name} code")
    env = dict(os.environ, KWKER_CPU=cpu, KWKER_FEATURES=features,
               KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(Path(__file__))], env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"({name}" in r.stdout and "avx512bf16 False" in r.stdout, r.stdout


def worker() -> int:
    """Every check above on the overridden target, a few shapes each; exit 1 on a failure."""
    from kwker.runtime.target import host_target
    torch.set_num_threads(2)
    checks = []
    for shape in [(2, 2, 70, 90, 17, 17), (1, 1, 1, 37, 17, 17), (2, 3, 3, 70, 40, 24),
                  (1, 2, 130, 300, 32, 32)]:
        for causal in (False, True):
            checks.append((f"bf16 {shape} causal={causal}", lambda s=shape, c=causal: run(s, c)))
    for mask in ("bool", "float"):
        checks.append((f"bf16 {mask} mask", lambda m=mask: run(
            (2, 2, 33, 65, 24, 40), mask=m, mask_shape=(2, 1, 33, 65), seed=4)))
    checks.append(("bf16 gqa causal", lambda: run((2, 8, 37, 53, 16, 16), True, kvh=2)))
    checks.append(("bf16 gqa decode", lambda: run((2, 6, 1, 37, 17, 17), kvh=3)))

    def gqa_f32(shape, kvh, causal):
        b, h, lq, lk, e, ev = shape
        q, k, v = torch.randn(b, h, lq, e), torch.randn(b, kvh, lk, e), torch.randn(b, kvh, lk, ev)
        y = make_sdpa(*shape, causal, kv_heads=kvh)(q, k, v)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)

    for shape, kvh in [((2, 8, 37, 53, 16, 16), 2), ((1, 4, 130, 300, 17, 17), 1),
                       ((2, 6, 2, 70, 40, 24), 3)]:
        for causal in (False, True):
            checks.append((f"f32 gqa {shape}/{kvh} causal={causal}",
                           lambda s=shape, g=kvh, c=causal: gqa_f32(s, g, c)))
    t = host_target()
    print(f"target {t.describe()} avx512bf16 {t.has('avx512bf16')}")
    failed = 0
    for name, fn in checks:
        try:
            fn()
            print(f"ok   {name}")
        except AssertionError as exc:
            failed += 1
            print(f"FAIL {name}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(worker())
