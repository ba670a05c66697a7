"""The kernels compile for AVX2+FMA and for AVX-512 targets and use that ISA's FMAs.

Nothing runs here: each spec is emitted for an overridden target, optimised and turned into
assembly, which must hold ymm FMAs (AVX2, no zmm at all) or zmm FMAs (AVX-512).
"""
import re

import pytest

from kwker.kernels import blocking
from kwker.kernels.specs import AttentionSpec, EltwiseSpec, GemmSpec, TopkGemmSpec
from kwker.runtime.compiler import compile_assembly
from kwker.runtime.kernel import ir_text
from kwker.runtime.target import make_target

AVX512 = make_target("skylake-avx512", "+avx,+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512dq")
AVX2 = make_target("haswell", "+avx,+avx2,+fma,-avx512f,-avx512bw,-avx512vl,-avx512dq")
TARGETS = {"avx512": (AVX512, "zmm", 16), "avx2": (AVX2, "ymm", 8)}


def micro_kernels_asm(asm: str) -> str:
    """The assembly of the module's micro-kernels (``uk.*``) alone: their accumulators are what
    must stay in registers (a packing routine may spill a transpose temporary)."""
    bodies = re.findall(r"^(uk\.[^:\s]+):\n(.*?)^\.Lfunc_end", asm, re.MULTILINE | re.DOTALL)
    assert bodies, "no micro-kernel in the module"
    return "\n".join(body for _, body in bodies)


def specs(target):
    lanes = blocking.lanes(target)
    big = blocking.choose(200, 300, 400, target).as_kwargs()
    small = blocking.choose(3, 300, 400, target).as_kwargs()
    nr = 2 * lanes
    return {
        "gemm": GemmSpec(200, 300, 400, 1, "packed", True, "gelu", True, **big),
        "gemm_small_m": GemmSpec(3, 300, 400, 1, "packed", True, "relu", False, **small),
        "matmul_nk": GemmSpec(200, 300, 400, 2, "nk", **big),
        "gelu": EltwiseSpec("gelu", 4096),
        "gelu_tanh": EltwiseSpec("gelu_tanh", 4096),
        "sdpa": AttentionSpec(2, 2, 100, 100, 32, 32, True, 0.0, "none", (), 2 * (12 if lanes
                              == 16 else 6), 128, nr, 12 if lanes == 16 else 6, 6),
        "topk": TopkGemmSpec(16, 5000, 64, 10, True, 8 if lanes == 16 else 6, 3 * lanes),
    }


@pytest.mark.parametrize("isa", sorted(TARGETS))
@pytest.mark.parametrize("name", ["gemm", "gemm_small_m", "matmul_nk", "gelu", "gelu_tanh",
                                  "sdpa", "topk"])
def test_kernel_uses_target_fma(isa, name):
    target, reg, lanes = TARGETS[isa]
    spec = specs(target)[name]
    text = ir_text(spec, target)
    assert f"llvm.fma.v{lanes}f32" in text
    _, asm = compile_assembly(text, target)
    fmas = re.findall(r"vfn?m(?:add|sub)\d{3}ps\s+[^\n]*%" + reg, asm)
    assert fmas, f"no {reg} FMA in {spec.symbol}"
    if isa == "avx2":
        assert "zmm" not in asm
    if name.startswith("gemm") or name == "matmul_nk":
        # pre-packed weights are streamed: prefetched on AVX-512 (gemm_micro.py), a runtime B
        # is packed into the caches by the kernel itself
        assert ("prefetcht0" in micro_kernels_asm(asm)) == (isa == "avx512" and name != "matmul_nk")
    # exported symbol, no libm calls for the maths
    assert re.search(rf"^{re.escape(spec.symbol)}:", asm, re.M)
    for libm in ("expf", "erff", "tanhf", "exp", "erf", "tanh"):
        assert not re.search(rf"\bcall\w*\s+{libm}\b", asm)


def test_gemm_micro_kernel_keeps_accumulators_in_registers():
    """The 12x32 AVX-512 tile: 24 independent zmm FMAs per k step, B and A from memory."""
    target = AVX512
    spec = GemmSpec(240, 256, 256, 1, "packed", **blocking.choose(240, 256, 256, target)
                    .as_kwargs())
    _, asm = compile_assembly(ir_text(spec, target), target)
    fma_lines = [ln for ln in asm.splitlines() if re.search(r"vfmadd231ps.*zmm", ln)]
    accs = {ln.split(",")[-1].strip() for ln in fma_lines}
    assert len(accs) >= 24
    assert not re.search(r"vmovups\s+%zmm\d+, -?\d*\(%rsp\)", micro_kernels_asm(asm)), \
        "accumulator spills"


def test_sdpa_softmax_uses_vscalef_on_avx512():
    spec = specs(AVX512)["sdpa"]
    _, asm = compile_assembly(ir_text(spec, AVX512), AVX512)
    assert "vscalefps" in asm


@pytest.mark.parametrize("op", ["exp", "tanh", "silu_mul"])
def test_exp_scales_with_vscalef_on_avx512_only(op):
    """vmath.exp's 2**n: one vscalefps on AVX-512 (the same bits as the exponent-field
    multiplies AVX2 keeps: tests/kernels/test_eltwise.py checks both against float64)."""
    for target, want in ((AVX512, True), (AVX2, False)):
        _, asm = compile_assembly(ir_text(EltwiseSpec(op, 0), target), target)
        assert ("vscalefps" in asm) == want, (op, target.name)


def test_topk_bf16_screening_uses_vdpbf16ps():
    target = make_target("znver4", AVX512.features + ",+avx512bf16")
    spec = TopkGemmSpec(32, 20000, 128, 10, True, 8, 48, "bf16")
    _, asm = compile_assembly(ir_text(spec, target), target)
    assert re.search(r"vdpbf16ps\s+[^\n]*%zmm", asm)
    assert re.search(r"vfmadd\d{3}ps\s+[^\n]*%zmm", asm)  # the float32 rescoring


def test_topk_int8_screening_uses_vpdpbusd():
    """One to four rows screen with int8 weights: checked in the assembly, so a CPU without
    AVX512_VNNI (which cannot run it) still checks the code."""
    target = make_target("znver4")
    spec = TopkGemmSpec(1, 20000, 128, 10, True, 1, 64, "int8")
    _, asm = compile_assembly(ir_text(spec, target), target)
    assert re.search(r"vpdpbusd\s+[^\n]*%zmm", asm)
    assert re.search(r"vfmadd\d{3}ps\s+[^\n]*%zmm", asm)  # the float32 rescoring


BF16_TARGETS = {  # name -> (target, register, instruction of the k step)
    "avx512bf16": (make_target("znver4", AVX512.features + ",+avx512bf16"), "zmm", "vdpbf16ps"),
    "avx512f": (AVX512, "zmm", "vfmadd231ps"),
    "avx2": (AVX2, "ymm", "vfmadd231ps"),
}


@pytest.mark.parametrize("isa", sorted(BF16_TARGETS))
@pytest.mark.parametrize("shape", [(240, 256, 512), (3, 300, 400)], ids=["tiles", "small_m"])
def test_bf16_gemm_instructions(isa, shape):
    """bf16 GEMMs step over k pairs with vdpbf16ps where the CPU has it, else widen to float32
    FMAs of the target's width; the accumulators of the big tile stay in registers."""
    target, reg, step = BF16_TARGETS[isa]
    m, n, k = shape
    blk = blocking.choose(m, n, k // 2, target, dtype="bf16").as_kwargs()
    spec = GemmSpec(m, n, k, 1, "packed", True, "gelu", True, **blk, dtype="bf16")
    _, asm = compile_assembly(ir_text(spec, target), target)
    lines = [ln for ln in asm.splitlines() if re.search(rf"{step}\s+[^\n]*%{reg}", ln)]
    assert lines, f"no {step} on {reg} in {spec.symbol}"
    if isa != "avx512bf16":
        assert "vdpbf16ps" not in asm
    if isa == "avx2":
        assert "zmm" not in asm
    if shape[0] > 8:
        accs = {ln.split(",")[-1].strip() for ln in lines}
        assert len(accs) >= (24 if reg == "zmm" else 8), accs
        # without the erf epilogue (whose constants may spill, outside the k loop): no spills
        plain = GemmSpec(m, n, k, 1, "packed", True, **blk, dtype="bf16")
        _, asm = compile_assembly(ir_text(plain, target), target)
        assert not re.search(rf"vmovups\s+%{reg}\d+, -?\d*\(%rsp\)",
                             micro_kernels_asm(asm)), "accumulator spills"
