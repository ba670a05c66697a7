"""The rotary-embedding kernel (kernels/rope.py) against transformers' composition, run by
ATen: bit for bit in float32 and bf16 (each product and the sum rounded as eager rounds them),
on q/k layouts as models make them (transposed, sliced, split), cos/sin broadcast every way,
row lengths off the vector width, NaN/inf/-0.0; eager's output layout; layouts the kernel
does not take give the composition's answer. The AVX2 code runs in a subprocess through the
target override."""
import os
import subprocess
import sys

import pytest
import torch

from kwker.kernels.rope import make_rope, rotate_half_rope
from kwker.runtime.target import host_target

B, T, H = 2, 5, 3


def layouts(d: int) -> dict:
    g = torch.Generator().manual_seed(d)
    return {
        "transposed": torch.randn(B, T, H, d, generator=g).transpose(1, 2),
        "contiguous": torch.randn(B, H, T, d, generator=g),
        "sliced": torch.randn(B, T, H, 2 * d, generator=g)[..., d:].transpose(1, 2),
        "split": torch.randn(B, T, 3 * H * d, generator=g).split(H * d, -1)[1]
                      .view(B, T, H, d).transpose(1, 2),
    }


COS_SHAPES = [(1, 1, T), (B, 1, T), (1, H, T), (B, H, T), (1, 1, 1)]


def check(d: int, dtype) -> int:
    """Every layout and cos/sin shape; returns the number of mismatches (printed)."""
    bad = 0
    fn = make_rope(d, dtype)
    for name, x in layouts(d).items():
        x = x.to(dtype)
        x[0, 0, 0, 0], x[0, 0, 0, d // 2], x[-1, -1, -1, -1] = float("nan"), float("inf"), -0.0
        for lead in COS_SHAPES:
            g = torch.Generator().manual_seed(hash((name, lead)) % 1000)
            cos = torch.randn(*lead, d, generator=g).to(dtype)
            sin = torch.randn(*lead, d, generator=g).to(dtype)
            if lead == (1, 1, T):
                cos[0, 0, 0, 0], sin[0, 0, 1, 1] = float("inf"), -0.0
            got, want = fn(x, cos, sin), rotate_half_rope(x, cos, sin)
            same = torch.equal(got.isnan(), want.isnan()) and \
                torch.equal(got.nan_to_num(0.0).view(torch.int16 if dtype == torch.bfloat16
                                                     else torch.int32),
                            want.nan_to_num(0.0).view(torch.int16 if dtype == torch.bfloat16
                                                      else torch.int32))
            layout = got.stride() == want.stride()
            if not (same and layout):
                bad += 1
                print("FAIL", d, dtype, name, lead, "values" if not same else "strides",
                      got.stride(), want.stride())
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d", [2, 64, 80, 128])
def test_rope_is_the_composition_bit_for_bit(d, dtype):
    assert check(d, dtype) == 0


def test_bf16_x_with_float32_cos_and_sin_is_the_promoted_composition():
    """Autocast's form: a bf16 projection times float32 cos/sin promotes to float32."""
    fn = make_rope(64, torch.float32, torch.bfloat16)
    for name, x in layouts(64).items():
        x = x.bfloat16()
        for lead in COS_SHAPES:
            cos, sin = torch.randn(*lead, 64), torch.randn(*lead, 64)
            got, want = fn(x, cos, sin), rotate_half_rope(x, cos, sin)
            assert got.dtype == torch.float32 and got.stride() == want.stride(), (name, lead)
            assert torch.equal(got, want), (name, lead)
    with pytest.raises(NotImplementedError):
        make_rope(64, torch.bfloat16, torch.float32)


def test_layouts_the_kernel_does_not_take_run_the_composition():
    fn = make_rope(64)
    x = torch.randn(2, 3, 5, 64)
    cos, sin = torch.randn(5, 64), torch.randn(5, 64)   # rank 2: broadcast by ATen only
    assert torch.equal(fn(x, cos, sin), rotate_half_rope(x, cos, sin))
    xs = torch.randn(2, 3, 5, 128)[..., ::2]             # rows not dense
    c4 = torch.randn(1, 1, 5, 64)
    assert torch.equal(fn(xs, c4, c4), rotate_half_rope(xs, c4, c4))
    bf = x.bfloat16()                                    # mixed dtypes: ATen's promotion
    assert torch.equal(fn(bf, c4, c4), rotate_half_rope(bf, c4, c4))
    with pytest.raises(RuntimeError):                    # ATen's error for sizes that clash
        fn(x, torch.randn(1, 1, 4, 64), torch.randn(1, 1, 4, 64))
    with pytest.raises(ValueError):
        make_rope(63)


def test_avx2_code(tmp_path):
    if not host_target().has("avx2"):
        pytest.skip(f"this CPU cannot run AVX2 code ({host_target().describe()})")
    env = dict(os.environ, KWKER_CPU="haswell", KWKER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("KWKER_FEATURES", None)
    r = subprocess.run([sys.executable, __file__, "worker"], env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0 and "all ok" in r.stdout, r.stdout + r.stderr


if __name__ == "__main__" and sys.argv[1:] == ["worker"]:
    print(host_target().describe())
    failed = sum(check(d, dt) for d in (80, 128) for dt in (torch.float32, torch.bfloat16))
    print("all ok" if not failed else f"{failed} failed")
    sys.exit(1 if failed else 0)
