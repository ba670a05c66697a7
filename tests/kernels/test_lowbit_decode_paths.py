"""The low-bit decode kernels' paths per CPU: ``vpdpbusd`` against the float path, the digits of
bf16 rows, each ISA's kernels, the weight stream's prefetch, and the AVX2 int4 folded tiles
(through ``KWKER_CPU=haswell`` on any host), against torchao's dequantised weights.
"""
import pytest
import torch
from torch import nn

torchao = pytest.importorskip("torchao")
from torchao.quantization import quantize_

from kwker.kernels.linear_lowbit import make_linear_lowbit

from .lowbit_helpers import FORMATS, assert_close, quantized, reference


def _vnni_host() -> bool:
    from kwker.runtime.target import host_target
    return host_target().has("avx512vnni")


VNNI_CASES = [("int8-channel", k) for k in (64, 70, 200, 777)] + \
    [("int4-group32", k) for k in (64, 96, 800)] + [("int4-group64", 192), ("int4-group128", 384),
                                                    ("int4-axis", 70), ("int4-axis", 300),
                                                    ("int4-group64-asym", 320)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt, k", VNNI_CASES, ids=[f"{f}-{k}" for f, k in VNNI_CASES])
def test_vpdpbusd_and_float_paths(fmt, k, dtype, monkeypatch):
    """int8 per output channel and int4 take vpdpbusd over x's byte planes (int4:
    signed digits) where the CPU has AVX512_VNNI, else the float path (forced here too): both
    agree with the reference on rows the planes take (ordinary, huge, a single nonzero) and on
    rows they hand to the float path (all zeros, below 2**-100, non-finite), in one call. int8:
    K whole steps of 64, a tail under one vector, odd; int4: groups of 32, 64 and 128 k and one
    per row, K a chunk of 128 or less, several, with a part chunk, zero points; several x rows
    of int4 on the float tiles. N is whole blocks of 8 W rows: the blocks' edges are
    test_each_format_every_row_count's (37 and 100 rows), and here they would double the tiles
    each of these kernels compiles (the test 77 -> 51 s)."""
    import kwker.kernels.linear_lowbit as lowbit
    lin = quantized(fmt, 48, k, dtype)
    lin.bias.data.zero_()    # each row's error is then against that row's own scale
    rows = [torch.randn(k), torch.randn(k) * 1e30, torch.zeros(k), torch.randn(k) * 1e-36,
            torch.randn(k).index_fill(0, torch.tensor([k - 1]), float("nan")),
            torch.zeros(k).index_fill(0, torch.tensor([k - 1]), 3.0), torch.randn(k) - 40]
    x = torch.stack(rows).to(dtype)
    ref = reference(lin, x, dtype=dtype)
    paths = {"float": False} if not _vnni_host() else {"vnni": True, "float": False}
    for name, vnni in paths.items():
        monkeypatch.setattr(lowbit, "_vnni", lambda spec, lanes, v=vnni: v and
                            lowbit.gemm_lowbit_vnni4.either_usable(spec, lanes))
        # a lone x row streams its W rows (m=1, or one row through the generic kernel)
        for m, one_by_one in ((1, True), (len(rows), False), (None, False), (None, True)):
            fn = make_linear_lowbit(lin.weight, None, m, dtype=dtype)
            # int4 takes vpdpbusd for a lone x row (m=1, or the generic kernel's single row)
            assert fn.specs[0].vnni == (vnni and (fmt.startswith("int8") or m in (1, None)))
            y = torch.cat([fn(x[i:i + 1]) for i in range(len(rows))]) if one_by_one else fn(x)
            assert torch.equal(y.isnan(), ref.isnan()), name
            for i in range(len(rows)):
                if i != 4:
                    assert_close(y[i], ref[i], dtype, f"{name} m={m} row {i}")
    if not _vnni_host():
        pytest.skip("this CPU has no AVX512_VNNI: the float path alone ran")


@pytest.mark.parametrize("k", [96, 800])
def test_bf16_decode_takes_two_digits_where_the_row_allows(k):
    """bf16 x takes int4's vpdpbusd path in two byte digits, x rounded to 2**-15 of its row's
    largest |x|, unless a few outliers would make that coarser than eager bf16's rounding:
    with one or two outliers 1000x the rest, their weights zero, the other products' sum stays
    within bf16 rounding of exact (two digits would put ~2% of it in error)."""
    if not _vnni_host():
        pytest.skip("this CPU has no AVX512_VNNI: bf16 x takes the float path")
    torch.manual_seed(0)
    lin = nn.Linear(k, 45).to(torch.bfloat16)
    lin.weight.data[:, :2] = 0.0
    lin.bias.data.zero_()
    config, kwargs = FORMATS["int4-group32"]
    quantize_(lin, config(**kwargs))
    fn = make_linear_lowbit(lin.weight, None, 1, dtype=torch.bfloat16)
    assert (fn.specs[0].vnni, fn.specs[0].digits) == (True, 2)
    for outliers in (0, 1, 2):
        x = torch.randn(1, k)
        x[0, :outliers] = 1000.0
        x = x.to(torch.bfloat16)
        ref = reference(lin, x, dtype=torch.bfloat16)
        err = (fn(x).double() - ref).abs()
        assert bool((err <= ref.abs() * 2 ** -8 + 1e-3 * ref.abs().max()).all()), \
            f"{outliers} outliers: error {err.max().item():g} against max |ref| " \
            f"{ref.abs().max().item():g}"


def test_vnni_kernels_hold_vpdpbusd():
    """The vpdpbusd kernels compile for a VNNI target whatever this host (their assembly):
    int8 per channel, and int4 in groups of 32 (its nibbles transposed by vpshufb), bf16 x in
    two digits too."""
    import re

    from kwker.kernels.specs import LowbitGemmSpec
    from kwker.runtime.compiler import compile_assembly
    from kwker.runtime.kernel import ir_text
    from kwker.runtime.target import make_target
    target = make_target("cascadelake", "")
    spec = LowbitGemmSpec(1, 100, 300, 8, 300, bias=True, vnni=True)
    _, asm = compile_assembly(ir_text(spec, target), target)
    assert re.search(r"vpdpbusd\s[^\n]*%zmm", asm)
    int4 = LowbitGemmSpec(0, 100, 320, 4, 32, bias=True, mr=1, vnni=True)
    _, asm = compile_assembly(ir_text(int4, target), target)
    assert re.search(r"vpdpbusd\s[^\n]*%zmm", asm) and re.search(r"vpshufb\s[^\n]*%zmm", asm)
    # bf16 x in two digits beside three: the two tiles' dot products (2 x 2 and 2 x 3)
    two = LowbitGemmSpec(1, 100, 320, 4, 32, dtype="bf16", mr=1, vnni=True, digits=2)
    _, asm = compile_assembly(ir_text(two, target), target)
    assert len(re.findall(r"vpdpbusd\s[^\n]*%zmm", asm)) >= 2 * 8 * (2 + 3)


@pytest.mark.parametrize("cpu, lanes", [("haswell", 8), ("znver4", 16)])
def test_decode_kernels_compile_for_each_isa(cpu, lanes):
    """The decode kernels' assembly for an AVX2 and an AVX-512 target, whatever this host: a
    lone x row streams int8 weights, prefetched ahead; int4 is looked up in a
    16-float table with vpermps on AVX-512, and folded (no table) on AVX2; weights read once
    are prefetched non-temporally on AVX2, into every cache level on AVX-512."""
    import re

    from kwker.kernels.specs import LowbitGemmSpec
    from kwker.runtime.compiler import compile_assembly
    from kwker.runtime.kernel import ir_text
    from kwker.runtime.target import make_target
    target = make_target(cpu, "")
    reg = "zmm" if lanes == 16 else "ymm"
    int8 = LowbitGemmSpec(1, 100, 320, 8, 32, zero_point=True, bias=True, lanes=lanes)
    _, asm = compile_assembly(ir_text(int8, target), target)
    assert re.search(rf"vcvtdq2ps\s[^\n]*%{reg}", asm)
    assert ("prefetchnta" in asm) == (lanes == 8) and ("prefetcht0" in asm) == (lanes == 16)
    int4 = LowbitGemmSpec(0, 100, 320, 4, 32, zero_point=True, lanes=lanes, mr=3, rr=4)
    _, asm = compile_assembly(ir_text(int4, target), target)
    assert bool(re.search(r"vpermps\s[^\n]*%zmm", asm)) == (lanes == 16)
    assert "prefetchnta" in asm or lanes == 16


SPECS_BY_PATH = {  # a decode spec (one x row) of each weight stream
    "int8 float": dict(m=1, n=100, k=320, bits=8, group=32, zero_point=True, bias=True),
    "int8 vpdpbusd": dict(m=1, n=100, k=300, bits=8, group=300, bias=True, vnni=True),
    "int4 float": dict(m=1, n=100, k=320, bits=4, group=32, zero_point=True),
    "int4 vpdpbusd": dict(m=1, n=100, k=320, bits=4, group=32, bias=True, vnni=True),
}


@pytest.mark.parametrize("path", sorted(SPECS_BY_PATH))
def test_decode_streams_prefetched_ahead_or_not_at_all(path):
    """``spec.ahead``: the decode kernels prefetch their weight stream that many bytes on
    (into every cache level, AVX-512), or with 0 (what Zen 4 measured faster: lowbit_stream)
    hold no prefetch at all."""
    from kwker.kernels.specs import LowbitGemmSpec
    from kwker.runtime.compiler import compile_assembly
    from kwker.runtime.kernel import ir_text
    from kwker.runtime.target import make_target
    target = make_target("znver4", "")
    for ahead in (4096, 0):
        spec = LowbitGemmSpec(**SPECS_BY_PATH[path], ahead=ahead)
        _, asm = compile_assembly(ir_text(spec, target), target)
        assert ("prefetch" in asm) == bool(ahead), ahead


@pytest.mark.parametrize("fmt", ["int8-channel", "int8-group32", "int4-group32",
                                 "int4-group64-asym"])
def test_decode_answers_alike_whatever_the_prefetch(fmt, monkeypatch):
    """The decode kernels built with and without prefetches give the same sums (the prefetch
    moves no data), as the dequantised reference, on vpdpbusd (where the CPU has it) and on
    the float path."""
    import kwker.kernels.linear_lowbit as lowbit
    lin = quantized(fmt, 45, 832)
    x = torch.randn(1, 832)
    ref = reference(lin, x)
    for vnni in (True, False) if _vnni_host() else (False,):
        monkeypatch.setattr(lowbit, "_vnni", lambda spec, lanes, v=vnni: v and
                            lowbit.gemm_lowbit_vnni4.either_usable(spec, lanes))
        fns = [make_linear_lowbit(lin.weight, lin.bias.detach(), 1, ahead=a) for a in (4096, 0)]
        assert [f.specs[0].ahead for f in fns] == [4096, 0]
        assert fns[0].specs[0].vnni == (vnni and fmt != "int8-group32")
        y = fns[1](x)
        assert torch.equal(fns[0](x), y)
        assert_close(y, ref, torch.float32, f"{fmt} vnni={vnni}")


FOLDED_CHECK = """
import torch
from kwker.kernels.linear_lowbit import LowbitTensor, dequantized, make_linear_lowbit
from kwker.runtime.target import host_target
assert host_target().vector_bits == 256, host_target().describe()
torch.manual_seed(2)
for n, k, group, asym in ((70, 77, 77, False), (100, 256, 32, False), (33, 960, 64, True)):
    groups = -(-k // group)
    w = LowbitTensor(torch.randint(-8, 8, (n, k), dtype=torch.int8),
                     torch.rand(n, groups) * 0.01 + 1e-3,
                     torch.randint(-3, 4, (n, groups), dtype=torch.int8) if asym else None,
                     group, 4, torch.float32)
    fns = {m: make_linear_lowbit(w, None, m) for m in (1, 3, None, 20)}  # no bias: x's digits
    assert len({f.buffers.w.data_ptr() for f in fns.values()}) == 1, "one packed copy"
    for m, fn in fns.items():
        rows = m or 5
        for scale in (1.0, 1e-36, 1e30):
            x = torch.randn(rows, k) * scale
            if scale == 1.0 and rows > 2:
                x[1, 3], x[2] = float("nan"), 0.0
            ref = x.double() @ dequantized(w).double().T
            y = fn(x)
            assert torch.equal(y.isnan(), ref.isnan()), (n, k, m, scale)
            fin = ref.isfinite().all(1)
            err = (y[fin].double() - ref[fin]).abs().max() / ref[fin].abs().max()
            assert err < 1e-5, (n, k, m, scale, float(err))
# x with a mean: each unit's zero-point term is taken off inside the unit (deferred to the end
# of the W row, the sums of x u grow to 8 sum x before they cancel: ~10x this error)
w = LowbitTensor(torch.randint(-8, 8, (64, 2048), dtype=torch.int8),
                 torch.rand(64, 64) * 0.01 + 1e-3, None, 32, 4, torch.float32)
x = torch.randn(1, 2048) + 5
ref = x.double() @ dequantized(w).double().T
err = (make_linear_lowbit(w, None, 1)(x).double() - ref).abs().max() / ref.abs().max()
assert err < 5e-7, float(err)
print("folded ok")
"""


def test_int4_folded_tiles_on_avx2(tmp_path):
    """The AVX2 int4 tiles (raw nibbles in place against x scaled per nibble, the zero-point
    term folded out), run on any x86-64 host through KWKER_CPU=haswell: decode rows 1 and 3,
    generic and prefill against the float64 reference, with zero, NaN, tiny (1e-36: must take
    the exact tiles) and large x; one packed copy of the weight for every row count."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, KWKER_CPU="haswell", KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", FOLDED_CHECK], env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0 and "folded ok" in r.stdout, r.stdout + r.stderr
