"""bf16 GEMMs (make_linear, make_matmul, make_linear_topk) against a float32 reference under
the accuracy contract: Kwker's max abs error <= 1.25 x eager bf16's + 1e-3 x max|reference|.
Odd sizes everywhere (odd K, M and N off the tile, K not a multiple of the K block), every
epilogue, the residual, both runtime-B layouts, batches. The fused GEMM + top-k must equal
``torch.topk`` of the unfused linear's bf16 scores exactly (tie order included, on tie-heavy
scores). The vdpbf16ps path on this CPU and the widened paths (AVX-512F without AVX512_BF16,
AVX2) run in subprocesses through the target override."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kwker.kernels.linear import make_linear
from kwker.kernels.matmul import make_matmul
from kwker.kernels.topk import make_linear_topk
from kwker.runtime.target import host_target

BF16 = torch.bfloat16
ACT = {"none": lambda t: t, "relu": torch.relu, "silu": F.silu, "sigmoid": torch.sigmoid,
       "tanh": torch.tanh, "gelu": F.gelu,
       "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}
LINEAR_CASES = [  # m, n, k, epilogue, residual, bias[, out: a float32 residual and output]
    (1, 64, 32, "none", False, True), (1, 4096, 1024, "none", False, True),
    (3, 37, 17, "gelu", False, True), (5, 33, 2, "relu", True, False),
    (8, 200, 1031, "gelu_tanh", True, True), (13, 100, 64, "none", True, True),
    (37, 77, 3, "none", False, True), (64, 256, 512, "gelu", False, True),
    (200, 300, 1030, "none", True, True), (131, 521, 4097, "relu", False, True),
    (3, 70, 33, "gelu_tanh", True, True, torch.float32),
    (45, 100, 300, "none", True, True, torch.float32),
    (21, 90, 77, "silu", True, True), (6, 40, 128, "silu", False, True, torch.float32),
    (17, 50, 40, "sigmoid", False, True), (2, 33, 70, "tanh", True, True),
]
MATMUL_CASES = [  # m, k, n, batch, b transposed
    (5, 17, 33, 1, False), (5, 17, 33, 1, True), (64, 64, 128, 4, False), (64, 64, 128, 4, True),
    (130, 300, 70, 2, False), (130, 301, 70, 2, True), (1, 32, 37, 3, False),
    (300, 1001, 500, 1, False),
]

# the generic (any row count) kernels an ISA path runs when another path runs them all: each takes
# 1-2 s to compile, and the micro-kernels they share with the fixed-size ones run every case
GENERIC_SAMPLE = {(1, 64, 32, "none", False, True), (8, 200, 1031, "gelu_tanh", True, True),
                  (37, 77, 3, "none", False, True), (131, 521, 4097, "relu", False, True),
                  (3, 70, 33, "gelu_tanh", True, True, torch.float32),
                  (130, 301, 70, 2, True), (1, 32, 37, 3, False)}

TOPK_CASES = [  # m, n, K, k, largest, tied (items repeat)
    (32, 20000, 128, 10, True, False), (1, 5000, 64, 50, True, True),
    (7, 3001, 33, 5, False, True), (100, 4096, 256, 20, True, True),
    (3, 1000, 17, 15, True, False), (2, 700, 40, 30, True, False),  # k * 64 > n: torch.topk
]


def max_error(a, ref):
    return (a.double() - ref.double()).abs().max().item()


def within_contract(got, eager, ref) -> tuple[bool, str]:
    bound = 1.25 * max_error(eager, ref) + 1e-3 * ref.abs().max().item()
    return max_error(got, ref) <= bound, f"kwker {max_error(got, ref)} eager " \
        f"{max_error(eager, ref)} bound {bound}"


def check_linear(m, n, k, epilogue, residual, bias, out=BF16, generic=False):
    """``generic``: the kernel built for any row count, called with ``m`` rows. ``out``
    float32: autocast's bf16 product joining a float32 residual stream (eager rounds the product
    to bf16, then adds it in float32)."""
    w = (torch.randn(n, k) / k ** 0.5).to(BF16)
    b = torch.randn(n).to(BF16) if bias else None
    x, r = torch.randn(m, k).to(BF16), torch.randn(m, n).to(out)
    fn = make_linear(w, b, None if generic else m, epilogue, residual, out_dtype=out)
    got = fn(x, r) if residual else fn(x)
    ref = ACT[epilogue](F.linear(x.float(), w.float(), None if b is None else b.float()))
    eager = ACT[epilogue](F.linear(x, w, b))
    if residual:
        ref, eager = ref + r.float(), eager + r
    assert got.dtype == out and got.shape == (m, n)
    return within_contract(got, eager, ref)


def check_matmul(m, k, n, batch, transposed, generic=False):
    a = torch.randn(batch, m, k).to(BF16)
    b = torch.randn(batch, n, k).to(BF16) if transposed else torch.randn(batch, k, n).to(BF16)
    sizes = (None, k, n, None) if generic else (m, k, n, batch)
    got = make_matmul(*sizes, transposed, dtype=BF16)(a, b)
    bb = b.mT if transposed else b
    return within_contract(got, a @ bb, a.float() @ bb.float())


def check_topk(m, n, kd, k, largest, tied):
    w = torch.randn(n, kd).to(BF16)
    if tied:
        w = torch.cat([w[: n // 10].repeat(10, 1), w[: n - n // 10 * 10]])
    x = torch.randn(m, kd).to(BF16)
    values, indices = make_linear_topk(w, m, k, largest)(x)
    expected = torch.topk(make_linear(w, None, m, dtype=BF16)(x), k, dim=-1, largest=largest)
    ok = torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    return ok, "differs from torch.topk of the unfused scores"


@pytest.mark.parametrize("case", TOPK_CASES, ids=str)
def test_linear_topk_bf16(case):
    ok, why = check_topk(*case)
    assert ok, why


@pytest.mark.parametrize("m", [3, 32, None], ids=["m3", "m32", "generic"])
@pytest.mark.parametrize("largest", [True, False])
def test_linear_topk_bf16_scores_that_round_together(m, largest, threads):
    """float32 scores that differ by less than a bf16 ulp: the kernel screens float32 scores,
    but which enter and in what order is decided on the rounded ones. ``x = (1, 1)``, so a score
    is ``a + b`` exactly, ``a`` one of a few bf16 values and ``b`` far below its half ulp, of
    either sign (rounding down, up, or to the same value as a bigger float32 score)."""
    torch.manual_seed(31)
    n = 6000
    a = torch.tensor([1.0, 1.0078125, 0.9921875, -1.0, 2.0])[torch.randint(0, 5, (n,))]
    b = torch.randint(-15, 16, (n,)).float() * 2.0 ** -12
    w = torch.stack([a, b], 1).to(BF16)
    rows = 32 if m is None else m
    x = torch.ones(rows, 2).to(BF16) * torch.tensor([1.0, 1.0]).to(BF16)
    x[1::2, 1] = -1.0  # the perturbation's sign flips on odd rows
    values, indices = make_linear_topk(w, m, 50, largest)(x)
    expected = torch.topk(make_linear(w, None, rows, dtype=BF16)(x), 50, dim=-1,
                          largest=largest)
    assert (x.float() @ w.float().t()).unique().numel() >= 5 * 31  # distinct in float32
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


@pytest.mark.parametrize("case", LINEAR_CASES, ids=str)
def test_linear_bf16(case):
    ok, why = check_linear(*case)
    assert ok, why


@pytest.mark.parametrize("epilogue", ["gelu", "gelu_tanh"])
def test_gelu_epilogue_rounds_the_exact_gelu(epilogue):
    """The bf16 GELU epilogues use cheaper forms (one erf polynomial; a sigmoid with a short
    exp2): their output is still the exact GELU of the float32 accumulator, rounded to bf16, to
    within that rounding (half an ulp, plus the float32 sum's own error), over the whole range
    GELU bends in and both tails."""
    torch.manual_seed(11)
    k = 64
    w = (torch.randn(512, k) / k ** 0.5).to(BF16)
    x = (torch.randn(96, k) * torch.linspace(0.1, 12, 96)[:, None]).to(BF16)
    got = make_linear(w, None, 96, epilogue)(x).double()
    ref = ACT[epilogue](x.double() @ w.double().T)
    assert ((got - ref).abs() <= ref.abs() * 2.0 ** -8 * 1.01 + 1e-5).all()
    assert got.min() < -0.1 and got.max() > 10  # the bend and the tails were reached


@pytest.mark.parametrize("case", MATMUL_CASES, ids=str)
def test_matmul_bf16(case):
    ok, why = check_matmul(*case)
    assert ok, why


def test_autocast_weights_are_rounded_as_autocast_rounds_them():
    """A float32 weight and bias with bf16 activations: autocast's linear, exactly what eager
    computes from the rounded weights (F.linear in float32 of the bf16 values, one rounding)."""
    torch.manual_seed(3)
    w, b, x = torch.randn(96, 80), torch.randn(96), torch.randn(24, 80).to(BF16)
    got = make_linear(w, b, 24, dtype=BF16)(x)
    ref = F.linear(x.float(), w.to(BF16).float(), b.to(BF16).float())
    assert torch.equal(got, ref.to(BF16)) or max_error(got, ref) <= 2 ** -7 * ref.abs().max()


@pytest.mark.parametrize("m, k, epilogue", [(24, 80, "gelu"), (None, 77, "none"), (1, 64, "relu")])
def test_float32_linear_on_bf16_products_where_allowed(m, k, epilogue):
    """``torch.set_float32_matmul_precision("medium")`` allows bf16 products for float32
    matmuls (oneDNN's reading): a float32 linear built then, where the CPU has fast bf16
    products, rounds x and the weights to bf16 and keeps the sums, the bias (not rounded), the
    epilogue, the residual and the output in float32. The setting is read per call: back at
    "highest", the same callable computes in float32 (its float32 kernel built then). Without
    fast bf16 products the kernel stays float32 throughout."""
    from kwker.kernels import blocking
    torch.manual_seed(5)
    n, rows = 96, m or 13
    w, b = torch.randn(n, k), torch.randn(n)
    x, res = torch.randn(rows, k), torch.randn(rows, n)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        fn = make_linear(w, b, m, epilogue, residual=True)
        got = fn(x, res)
        torch.set_float32_matmul_precision("highest")
        again = fn(x, res)
    finally:
        torch.set_float32_matmul_precision(before)
    exact = ACT[epilogue](x.double() @ w.double().T + b.double()) + res.double()
    rounded = ACT[epilogue](x.to(BF16).double() @ w.to(BF16).double().T + b.double()) + \
        res.double()
    fast = blocking.fast_bf16()
    assert got.dtype == again.dtype == torch.float32
    assert max_error(got, rounded if fast else exact) <= 1e-5 * exact.abs().max()
    assert fast == (max_error(got, exact) > 1e-4 * exact.abs().max())
    assert max_error(again, exact) <= 1e-5 * exact.abs().max()


def test_nan_and_inf_propagate():
    w = torch.randn(40, 16).to(BF16)
    x = torch.randn(6, 16).to(BF16)
    x[1, 3], x[2, 5] = float("nan"), float("inf")
    got = make_linear(w, None, 6)(x)
    ref = F.linear(x.float(), w.float())
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
    assert (got.view(torch.int16)[got.isnan()] == 0x7FC0).all()  # ATen's rounding of a NaN


def test_bad_inputs():
    fn = make_linear(torch.randn(8, 6).to(BF16), None, 4)
    with pytest.raises(NotImplementedError):
        fn(torch.randn(4, 6))  # float32 into a bf16 kernel
    with pytest.raises(ValueError):
        fn(torch.randn(5, 6).to(BF16))
    with pytest.raises(NotImplementedError):
        make_linear(torch.randn(8, 6).half(), None, 4)


ISA_PATHS = {  # name -> (KWKER_CPU, KWKER_FEATURES ("" = the CPU's own), what must run)
    "avx512-bf16": ("znver4", "", "avx512bf16"),
    "avx512f": ("skylake-avx512", "", "avx512f"),
    "avx2": ("znver3", "", "avx2"),
}


@pytest.mark.parametrize("isa", sorted(ISA_PATHS))
def test_isa_paths_run(isa, tmp_path):
    """Each ISA's bf16 micro-kernel (vdpbf16ps, widened AVX-512, widened AVX2) on this machine;
    the first path this CPU can run (in ``ISA_PATHS``' order) runs every generic kernel, the
    others ``GENERIC_SAMPLE``."""
    cpu, features, needs = ISA_PATHS[isa]
    if not host_target().has(needs):
        pytest.skip(f"this CPU cannot run {needs} code ({host_target().describe()}); its "
                    "assembly is checked in tests/codegen/test_isa.py")
    first = next(name for name, (_, _, n) in ISA_PATHS.items() if host_target().has(n))
    env = dict(os.environ, KWKER_CPU=cpu, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("KWKER_FEATURES", None)
    r = subprocess.run([sys.executable, __file__, "worker", "all" if isa == first else "sample"],
                       env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all ok" in r.stdout, r.stdout


def run_gemm_cases(linear_cases, matmul_cases, generic_only: set | None = None) -> int:
    """Every case for its sizes, and generic over the rows (every case, or those in
    ``generic_only``), printed; the number that failed."""
    assert generic_only is None or generic_only <= {*linear_cases, *matmul_cases}, generic_only
    bad = 0
    for generic in (False, True):
        for what, check, cases in (("linear", check_linear, linear_cases),
                                   ("matmul", check_matmul, matmul_cases)):
            for case in cases:
                if generic and generic_only is not None and case not in generic_only:
                    continue
                ok, why = check(*case, generic=generic)
                bad += not ok
                print(what, case, "generic" * generic, "ok" if ok else "FAIL " + why)
    return bad


def _worker(generic: str) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    print(host_target().describe(), "avx512bf16" if host_target().has("avx512bf16") else "")
    bad = run_gemm_cases(LINEAR_CASES, MATMUL_CASES,
                         None if generic == "all" else GENERIC_SAMPLE)
    for case in TOPK_CASES:
        ok, why = check_topk(*case)
        bad += not ok
        print("linear_topk", case, "ok" if ok else "FAIL " + why)
    if not bad:
        print("all ok")
    return 1 if bad else 0


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(sys.argv[2]))
