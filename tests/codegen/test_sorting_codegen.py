"""Sorting kernels: IR and assembly for other targets (no execution), and a portable-ISA run."""
import os
import subprocess
import sys
import textwrap

import pytest

from kwker.codegen import sorting
from kwker.codegen.sorting import SPLIT_LEVELS, task_slot
from kwker.eager_specs import generic_specs
from kwker.runtime.compiler import compile_assembly
from kwker.runtime.target import make_target
from kwker.spec import SortingSpec

AVX512 = make_target("znver4", "+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512dq,+bmi,+bmi2")
AVX2 = make_target("haswell", "+avx2,+fma,+bmi,+bmi2,-avx512f")


def test_every_generic_spec_emits_valid_ir():
    import llvmlite.binding as llvm
    for spec in generic_specs():
        llvm.parse_assembly(str(sorting.emit(spec, AVX2))).verify()


@pytest.mark.parametrize("target,reg", [(AVX512, "zmm"), (AVX2, "ymm")], ids=["avx512", "avx2"])
def test_block_partition_uses_vector_compares(target, reg):
    spec = SortingSpec("sort", "float32")
    _, asm = compile_assembly(str(sorting.emit(spec, target)), target)
    assert reg in asm
    if reg == "zmm":  # stopper masks land in AVX-512 mask registers
        assert "vpcmp" in asm and "%k" in asm
    else:
        assert "vpcmpgt" in asm and "%zmm" not in asm


def test_codegen_does_not_import_torch():
    code = "import sys, kwker.codegen.sorting, kwker.codegen.sortalgo; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_portable_isa_matches_aten(tmp_path):
    """Kernels built for a CPU without AVX (KWKER_CPU override) still give ATen's answers."""
    script = textwrap.dedent("""
        import torch
        import kwker.ops.sorting as S
        import kwker.torch_ops as kto
        from kwker.runtime.target import host_target
        assert host_target().vector_bits == 128, host_target()
        S.MIN_NUMEL = dict.fromkeys(S.MIN_NUMEL, 0)
        S.MIN_ROW = dict.fromkeys(S.MIN_ROW, 0)
        g = torch.Generator().manual_seed(0)
        for x in (torch.randint(0, 4, (3, 700), generator=g).float(),
                  torch.randn(2, 3000, generator=g, dtype=torch.float64),
                  torch.randint(-50, 50, (4, 333), generator=g)):
            fns = [lambda: torch.sort(x), lambda: torch.sort(x, stable=True, descending=True),
                   lambda: torch.topk(x, 5), lambda: torch.topk(x, 200, largest=False),
                   lambda: torch.kthvalue(x, 77), lambda: torch.median(x, 1),
                   lambda: torch.mode(x, 1), lambda: torch.median(x)]
            if x.dtype.is_floating_point:
                fns.append(lambda: torch.quantile(x, torch.tensor([.2, .7], dtype=x.dtype), 1))
            for fn in fns:
                want = fn()
                with kto.accelerated():
                    got = fn()
                want = want if isinstance(want, tuple) else (want,)
                got = got if isinstance(got, tuple) else (got,)
                assert all(torch.equal(a, b) for a, b in zip(got, want)), fn
        print("ok")
    """)
    env = dict(os.environ, KWKER_CPU="x86-64-v2", KWKER_FEATURES="+sse4.2,+popcnt,-avx,-avx2",
               KWKER_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("levels", range(1, SPLIT_LEVELS + 1))
def test_split_ranges_reach_every_thread(levels):
    """A long row partitioned ``levels`` times leaves 2**levels real ranges among the
    2**SPLIT_LEVELS tasks (the others empty); the workers deal slots round-robin, so the real
    ranges must fill the first slots, one per thread for 2**levels threads."""
    ntask = 2 ** SPLIT_LEVELS
    real = [t for t in range(ntask) if t % 2 ** (SPLIT_LEVELS - levels) == 0]
    assert sorted(task_slot(t) for t in real) == list(range(2 ** levels))
    assert sorted(task_slot(t) for t in range(ntask)) == list(range(ntask))
