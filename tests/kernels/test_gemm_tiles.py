"""The GEMM's tile path (codegen/gemm_tile.py) against references, natively and emulated.

- Emulated tiles (``KWKER_TILES=emulate``: each tile instruction as AVX-512 code of its
  semantics) run on any AVX-512 CPU, in a subprocess: every linear and matmul case (odd M, N
  and K, K not a multiple of 32, every epilogue, residual, batches, generic sizes) against the
  float32 reference under the bf16 accuracy contract.
- Where this CPU has AMX and Linux grants the tile state, the same cases run natively, and
  native and emulated outputs agree within float32 accumulation error.
- The native build's assembly (compiled for Sapphire Rapids, runs nowhere) holds ``ldtilecfg``,
  ``tdpbf16ps`` and ``tilerelease`` and spills no tile register; the emulated build holds no
  tile instruction.
- The fused top-k on tiles, float32 (its bf16 screen) and bf16 (its scores): torch.topk's
  answer on the scores Kwker's linear gives, ties included, for fixed row counts and for any
  (the tile kernel from ``TILE_MIN_ROWS`` rows, the vector one below).
- The int8 tile GEMM (u8 x s8 on ``tdpbusd``, per-column scales) equals float32 arithmetic on
  the exact integer sums, bit for bit, natively and emulated; so does its vector form on
  ``vpdpbusd`` (AVX512_VNNI), natively where the CPU has VNNI, and in the assembly anywhere.
- A refused tile permission leaves the target without tiles and says why.
"""
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from filelock import FileLock

from kwker.codegen.fused_topk import TOPK_TILE
from kwker.kernels import blocking, topk
from kwker.kernels.linear import make_linear
from kwker.kernels.linear_int8 import make_linear_u8s8
from kwker.kernels.specs import GemmSpec, TopkGemmSpec, instruction_path
from kwker.kernels.topk import make_linear_topk
from kwker.runtime import cache, tile_permission
from kwker.runtime.compiler import compile_assembly
from kwker.runtime.kernel import emit, ir_text
from kwker.runtime.target import host_target, make_target, tile_mode

sys.path.insert(0, os.path.dirname(__file__))
from test_gemm_bf16 import check_linear, check_matmul, run_gemm_cases  # noqa: E402
from test_gemm_bf16 import check_topk as check_bf16_topk  # noqa: E402
from test_topk import check as check_topk  # noqa: E402
from test_topk import with_special_values

BF16 = torch.bfloat16
LINEAR_CASES = [  # m, n, k, epilogue, residual, bias: edges of rows, columns and K steps
    (9, 40, 18, "none", False, True), (32, 32, 32, "relu", False, False),
    (33, 47, 62, "gelu", True, True), (64, 96, 64, "gelu_tanh", False, True),
    (100, 300, 1030, "none", True, True), (131, 521, 4097, "relu", False, True),
    (200, 64, 1600, "gelu", True, False),
    (97, 200, 2500, "gelu_tanh", True, True),  # deferred epilogue across 2 K blocks
    (70, 100, 300, "gelu", True, True, torch.float32),  # a float32 residual and output
    (40, 64, 2200, "none", True, False, torch.float32),
    (50, 70, 90, "silu", True, True), (37, 64, 1300, "silu", False, True, torch.float32),
    (40, 45, 64, "sigmoid", True, True), (33, 96, 100, "tanh", False, True),
    (1100, 1024, 1024, "gelu", True, True),  # B past L2: two chunks of up to 1024 rows
    (520, 1000, 64, "gelu", True, True),  # fewer rows than columns, split by rows on 2 threads
]
MATMUL_CASES = [  # m, k, n, batch, b transposed
    (40, 17, 33, 1, False), (40, 17, 33, 1, True), (64, 64, 128, 4, False),
    (64, 64, 128, 4, True), (130, 301, 70, 2, False), (130, 301, 70, 2, True),
    (300, 1700, 100, 1, False), (70, 2300, 60, 1, True),  # the last in 2 K blocks
]
# the cases the emulation without AVX512_BF16 runs, fixed and generic over rows: its products
# are one helper of their own (widened FMAs), the tiling, edges and epilogues around them the
# same code that this CPU's features run on every case (K odd, over a K block, float32 out)
SAMPLE = {(9, 40, 18, "none", False, True), (131, 521, 4097, "relu", False, True),
          (97, 200, 2500, "gelu_tanh", True, True),
          (70, 100, 300, "gelu", True, True, torch.float32),
          (130, 301, 70, 2, True), (70, 2300, 60, 1, True)}
SAPPHIRE = make_target("sapphirerapids")
EMULATED = make_target("sapphirerapids", tiles="emulated")


def _has_avx512() -> bool:
    return host_target().vector_bits == 512


def _run_worker(tmp_path, tiles: str, out: str, cpu: str = "", generic: str = "all") -> str:
    env = dict(os.environ, KWKER_TILES=tiles, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("KWKER_FEATURES", None)
    if cpu:
        env["KWKER_CPU"] = cpu
    r = subprocess.run([sys.executable, __file__, "worker", out, generic], env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _outputs() -> dict:
    """Every case's output, from fixed inputs: the worker's and this process's are comparable."""
    results = {}
    for i, (m, n, k, epilogue, residual, bias, *out) in enumerate(LINEAR_CASES):
        out = out[0] if out else BF16
        g = torch.Generator().manual_seed(i)
        w = (torch.randn(n, k, generator=g) / k ** 0.5).to(BF16)
        b = torch.randn(n, generator=g).to(BF16) if bias else None
        x, r = torch.randn(m, k, generator=g).to(BF16), torch.randn(m, n, generator=g).to(out)
        for generic in (False, True):
            fn = make_linear(w, b, None if generic else m, epilogue, residual, out_dtype=out)
            assert fn.spec.path == "tile", fn.spec
            results[f"linear{i}{'g' * generic}"] = fn(x, r) if residual else fn(x)
    return results


INT8_CASES = [(40, 70, 100, False, True), (64, 64, 64, False, False), (33, 300, 1030, True, True),
              (9, 33, 3, True, False), (200, 96, 256, False, True)]  # m, n, k, generic, bias


def check_int8(m, n, k, generic, bias) -> tuple[bool, str]:
    """u8 x s8 on tdpbusd: float32(exact int32 sum) * scale + bias, bit for bit."""
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    x = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    scale = torch.rand(n, generator=g) * 0.01
    b = torch.randn(n, generator=g) if bias else None
    got = make_linear_u8s8(w, scale, b, None if generic else m)(x)
    ref = (x.long() @ w.long().T).float() * scale
    if b is not None:
        ref = ref + b
    return torch.equal(got, ref), f"max diff {(got - ref).abs().max().item()}"


TOPK_CASES = [(32, 20000, 128, 10, True), (7, 5000, 64, 50, True), (33, 3001, 33, 5, False),
              (100, 4096, 256, 20, True)]  # m, n, K, k, largest


BF16_TOPK_CASES = [(32, 20000, 128, 10, True, False), (7, 5000, 64, 50, True, True),
                   (33, 3001, 33, 5, False, True), (100, 4096, 256, 20, True, True)]


def check_topk_screen(m, n, kd, k, largest) -> None:
    """The float32 fused top-k with its bf16 screen on tiles, and with AVX512_VNNI its int8
    screen (the default there): close values on random scores, and exactly torch.topk's values
    and tie order on small-integer (exact, tie-heavy) ones."""
    g = torch.Generator().manual_seed(m + n)
    w, x = torch.randn(n, kd, generator=g) / kd ** 0.5, torch.randn(m, kd, generator=g)
    wi = torch.randint(-2, 3, (n, kd), generator=g).float()
    xi = torch.randint(-2, 3, (m, kd), generator=g).float()
    int8 = topk._int8_screens(kd, host_target())
    assert make_linear_topk(w, m, k, largest).spec.path == "tile"
    for approx in ("bf16", "int8")[:1 + int8]:
        for weights, rows, exact in ((w, x, False), (wi, xi, True)):
            fn = topk._build(weights, m, k, largest, torch.float32, False, approx, True)
            check_topk(weights, rows, k, largest, exact=exact, fn=fn)


def check_topk_generic(half: bool) -> None:
    """The fused top-k for any row count: the tile path's kernel from ``TILE_MIN_ROWS`` rows on,
    the vector path's below; torch.topk's values and tie order at each count (small integers:
    every score exact, ties plentiful; float32 with its bf16 screen, or bf16 scores)."""
    g = torch.Generator().manual_seed(5 + half)
    dt = BF16 if half else torch.float32
    w = torch.randint(-2, 3, (3001, 48), generator=g).float().to(dt)
    x = torch.randint(-2, 3, (40, 48), generator=g).float().to(dt)
    scores = x.float() @ w.float().t()  # exact, in bf16 too (|score| <= 192)
    for largest in (True, False):
        f = make_linear_topk(w, None, 10, largest, dtype=dt)
        assert f.spec.path == "tile" and f.spec.m == 0
        for m in (1, 4, blocking.TILE_MIN_ROWS, 16, 17, 40):
            v, i = f(x[:m])
            rv, ri = torch.topk(scores[:m], 10, largest=largest)
            assert torch.equal(i, ri) and torch.equal(v.float(), rv), (half, largest, m)


SPECIAL_SCREEN_CASES = ["nan_w", "inf_w", "nan_x", "zero_x", "tiny", "huge", "smallest"]


def check_topk_screen_special(case: str) -> None:
    """The tile screens' whole-row test (each row's heap root moved by the widest bound), bf16
    and, with AVX512_VNNI, int8 (the default there), on non-finite, zero, subnormal and huge
    scores: torch.topk's indices, NaN included."""
    g = torch.Generator().manual_seed(len(case))
    w, x = torch.randn(3000, 48, generator=g), torch.randn(20, 48, generator=g)
    largest = case != "smallest"
    w, x = with_special_values(case, w, x)
    if case == "tiny":
        w, x = w * 1e-20, x * 1e-21
    elif case == "huge":
        w, x = w * 1e17, x * 1e17
    int8 = topk._int8_screens(w.shape[1], host_target())
    f = make_linear_topk(w, 20, 10, largest)
    assert f.spec.path == "tile" and f.spec.approx == ("int8" if int8 else "bf16")
    rv, ri = torch.topk(x @ w.t(), 10, largest=largest)
    for approx in ("bf16", "int8")[:1 + int8]:
        v, i = topk._build(w, 20, 10, largest, torch.float32, False, approx, True)(x)
        assert torch.equal(i, ri), (case, approx)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=0, equal_nan=True)


def _worker(out: str, generic: str = "all") -> int:
    torch.set_num_threads(2)
    print(host_target().describe())
    assert host_target().tiles in ("amx", "emulated"), host_target()
    bad = 0
    for case in INT8_CASES:
        ok, why = check_int8(*case)
        bad += not ok
        print("int8", case, "ok" if ok else "FAIL " + why)
    for case in TOPK_CASES if host_target().has("avx512bf16") else ():   # the screen needs it
        check_topk_screen(*case)   # raises on a mismatch
        print("topk screen", case, "ok")
    for case in SPECIAL_SCREEN_CASES if host_target().has("avx512bf16") else ():
        check_topk_screen_special(case)
        print("topk screen", case, "ok")
    for half in (False, True) if host_target().has("avx512bf16") else (True,):
        check_topk_generic(half)   # raises on a mismatch
        print("topk any rows", "bf16" if half else "float32", "ok")
    for case in BF16_TOPK_CASES:
        ok, why = check_bf16_topk(*case)
        bad += not ok
        print("bf16 topk", case, "ok" if ok else "FAIL " + why)
    if generic == "all":
        bad += run_gemm_cases(LINEAR_CASES, MATMUL_CASES)
    else:
        bad += run_gemm_cases([c for c in LINEAR_CASES if c in SAMPLE],
                              [c for c in MATMUL_CASES if c in SAMPLE])
    if out != "-":   # for the native run's comparison
        torch.save(_outputs(), out)
    if not bad:
        print("all ok")
    return 1 if bad else 0


@pytest.fixture(scope="session")
def emulated(tmp_path_factory, worker_id):
    """{cpu: (the emulated worker's stdout, its outputs file: this CPU's, where it has AMX)},
    each worker run once per suite: under xdist in a directory every xdist worker shares, behind
    a lock, so that the native test does not run the emulated worker again beside the emulated
    test (~40 s of compiles)."""
    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":   # each xdist worker's base is a child of the run's
        root = root.parent

    def run(cpu: str):
        if not _has_avx512():
            pytest.skip(f"emulated tiles are AVX-512 code; this CPU is "
                        f"{host_target().describe()}")
        tmp = root / f"emulated-tiles-{cpu or 'this-cpu'}"
        with FileLock(str(tmp) + ".lock"):
            if not (tmp / "stdout.txt").exists():
                tmp.mkdir(exist_ok=True)
                # every case on this CPU's features, a sample on the other; the outputs only
                # where the native tiles run to compare with them
                out = str(tmp / "out.pt") if not cpu and host_target().tiles == "amx" else "-"
                stdout = _run_worker(tmp, "emulate", out, cpu, "sample" if cpu else "all")
                (tmp / "stdout.txt").write_text(stdout)   # written last: the run is whole
        return (tmp / "stdout.txt").read_text(), tmp / "out.pt"
    return run


@pytest.mark.parametrize("cpu", ["", "skylake-avx512"], ids=["this-cpu", "no-avx512bf16"])
def test_emulated_tiles_match_the_reference(emulated, cpu):
    """On this CPU's features, and on AVX-512 without AVX512_BF16 (the emulated products are
    then widened FMAs)."""
    stdout, _ = emulated(cpu)
    assert "emulated tiles" in stdout and "all ok" in stdout, stdout
    assert cpu in stdout.splitlines()[0]


def test_native_tiles_match_the_reference_and_the_emulation(emulated, threads, native_tiles):
    for case in LINEAR_CASES:
        for generic in (False, True):
            ok, why = check_linear(*case, generic=generic)
            assert ok, (case, generic, why)
    for case in MATMUL_CASES:
        for generic in (False, True):
            ok, why = check_matmul(*case, generic=generic)
            assert ok, (case, generic, why)
    if threads == 2 and _has_avx512():
        saved, native = torch.load(emulated("")[1]), _outputs()
        for name, got in native.items():
            ref = saved[name].float()
            # float32 sums in another order, then one rounding to bf16: one ulp apart at most
            tol = 2.0 ** -7 * ref.abs() + 1e-5 * ref.abs().max()
            assert ((got.float() - ref).abs() <= tol).all(), name


@pytest.mark.parametrize("case", INT8_CASES, ids=str)
def test_native_int8_tiles(case, threads, native_tiles):
    ok, why = check_int8(*case)
    assert ok, why


def _vnni_target(monkeypatch):
    """This CPU without tiles, for the vector path of the int8 GEMM; skips without VNNI."""
    from dataclasses import replace

    import kwker.kernels.linear_int8 as linear_int8
    from kwker.runtime import kernel
    target = host_target()
    if not (target.vector_bits == 512 and target.has("avx512vnni")):
        pytest.skip(f"vpdpbusd needs AVX512_VNNI; this CPU: {target.describe()}")
    vector = replace(target, tiles="")
    for module in (linear_int8, kernel):
        monkeypatch.setattr(module, "host_target", lambda: vector)
    return vector


INT8_VECTOR_CASES = INT8_CASES + [(300, 100, 4100, False, True), (50, 65, 2000, True, False)]


@pytest.mark.parametrize("case", INT8_VECTOR_CASES, ids=str)
def test_native_int8_on_vpdpbusd(case, monkeypatch, tmp_path):
    """The int8 GEMM's vector form (``vpdpbusd``, gemm_micro.py): the tile path's int8 panels and
    column scales, K over one block (int32 sums crossing K blocks as their bits), edge tiles,
    generic rows, with and without a bias; bit for bit against the exact integer sums."""
    _vnni_target(monkeypatch)
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path))
    m, n, k = case[:3]
    spec = make_linear_u8s8(torch.zeros(n, k, dtype=torch.int8), torch.ones(n)).spec
    assert spec.path == "vector" and spec.dtype == "u8s8", spec
    ok, why = check_int8(*case)
    assert ok, why


def test_int8_vector_build_uses_vpdpbusd():
    """The vector int8 GEMM compiled for an AVX512_VNNI CPU without tiles (Zen 4): vpdpbusd on
    zmm registers, no tile instruction; a CPU with neither is refused."""
    target = make_target("znver4", "")
    spec = GemmSpec(64, 96, 256, 1, "packed", True, **blocking.vnni_blocking(96, 64).as_kwargs(),
                    dtype="u8s8")
    _, asm = compile_assembly(ir_text(spec, target), target)
    assert re.search(r"vpdpbusd\s[^\n]*%zmm", asm) and not re.search(r"\btdp", asm)
    assert instruction_path(spec, target) == "avx512-vnni"
    with pytest.raises(ValueError, match="u8s8"):
        emit(spec, make_target("haswell", ""))


@pytest.mark.parametrize("case", TOPK_CASES, ids=str)
def test_native_topk_screen_on_tiles(case, threads, native_tiles):
    check_topk_screen(*case)


@pytest.mark.parametrize("case", SPECIAL_SCREEN_CASES)
def test_native_topk_screen_special_values(case, threads, native_tiles):
    check_topk_screen_special(case)


@pytest.mark.parametrize("half", [False, True], ids=["float32", "bf16"])
def test_native_topk_any_rows_on_tiles(half, threads, native_tiles):
    check_topk_generic(half)


@pytest.mark.parametrize("case", BF16_TOPK_CASES, ids=str)
def test_native_bf16_topk_on_tiles(case, threads, native_tiles):
    """bf16 scores on tiles: torch.topk of Kwker's own bf16 linear, ties included."""
    m, n, kd, k = case[:4]
    assert make_linear_topk(torch.randn(n, kd).to(BF16), m, k).spec.path == "tile"
    ok, why = check_bf16_topk(*case)
    assert ok, why


def test_int8_build_uses_tdpbusd():
    spec = GemmSpec(64, 96, 256, 1, "packed", True, **blocking.tile_blocking(96, 64).as_kwargs(),
                    dtype="u8s8")
    _, asm = compile_assembly(ir_text(spec, SAPPHIRE), SAPPHIRE)
    assert re.search(r"\btdpbusd\b", asm) and not re.search(r"\btdpbf16ps\b", asm)
    with pytest.raises(ValueError, match="u8s8"):
        emit(GemmSpec(64, 96, 256, 1, "kn", **blocking.tile_blocking(96, 64).as_kwargs(),
                      dtype="u8s8"), SAPPHIRE)


@pytest.mark.parametrize("planes, bits, group", [(3, 8, 32), (2, 8, 32), (2, 12, 32),
                                                  (2, 12, 128), (2, 12, 64)])
def test_grouped_planes_build_restarts_tiles_per_group(planes, bits, group):
    """int4's grouped byte planes on the tiles (gemm_tile_grouped.py): per group of 32 k, the
    four accumulators zeroed, four products and the four stored for the combine; 12-bit planes
    take x's unsigned low digits on tdpbusd and its signed high digits on tdpbssd (no offset),
    and with a scale per 64 or 128 k a run of two or four groups' products before one store
    (then single groups for a K block's rest); the float sums of the x rows stay in registers
    (nothing spilled to the stack). 8-bit planes keep a store a group whatever the scale's k."""
    # K of 200 words: sub-blocks of 64, 64, 64 and 8 words (12-bit: 4, 4, 4 and a last group)
    spec = GemmSpec(0, 96, 800, 1, "packed", True, "gelu", True,
                    **blocking.tile_blocking(96, 200).as_kwargs(), dtype="u8s8", planes=planes,
                    ldo=96, b_group=group, plane_bits=bits)
    _, asm = compile_assembly(ir_text(spec, SAPPHIRE), SAPPHIRE)
    run = group // 32 if bits == 12 else 1
    counts = {op: len(re.findall(rf"\b{op}\b", asm)) for op in ("tilezero", "tdpbusd",
                                                                  "tdpbssd", "tilestored")}
    products = 4 if run == 1 else 4 * run + 4      # (a run's body and the single groups')
    high = products // 2 if bits == 12 else 0
    assert counts == {"tilezero": 4 if run == 1 else 8, "tdpbusd": products - high,
                      "tdpbssd": high, "tilestored": 4 if run == 1 else 8}, counts
    assert "Spill" not in asm and "Reload" not in asm
    _assert_eight_tile_registers(asm, "tdpbusd", "tdpbssd")
    if bits == 12:   # two planes of 12-bit digits against grouped panels, on the tiles only
        with pytest.raises(ValueError, match="12-bit planes"):
            emit(replace(spec, planes=3), SAPPHIRE)
    with pytest.raises(ValueError, match="a multiple of 32"):
        emit(replace(spec, b_group=48), SAPPHIRE)


def _assert_eight_tile_registers(asm: str, *ops: str) -> None:
    """The products of a 2 x 2 step read four operand tiles in four registers, apart from the
    four accumulators' (tiles.tile_step): with one register for two operands a load waits for
    the product before it."""
    found = re.findall(rf"\b(?:{'|'.join(ops)})\s+%(tmm\d), %(tmm\d), %(tmm\d)", asm)
    sources = {r for operands in found for r in operands[:2]}
    accumulators = {operands[2] for operands in found}
    assert len(sources) == len(accumulators) == 4 and not sources & accumulators, found


def _tile_spec(m=200, n=300, k=402, layout="packed", epilogue="gelu", residual=True):
    blk = blocking.choose(m, n, k // 2, SAPPHIRE, b_layout=layout, dtype="bf16")
    assert blk.path == "tile"
    return GemmSpec(m, n, k, 1, layout, layout == "packed", epilogue, residual,
                    **blk.as_kwargs(), dtype="bf16")


@pytest.mark.parametrize("layout", ["packed", "kn", "nk"])
def test_native_build_keeps_tiles_in_registers(layout):
    """ldtilecfg once, tdpbf16ps in the K loop, tilerelease; no tile spilled to the stack.
    B tiles are loaded around L1 (tileloaddt1), A tiles through it. Pre-packed weights are
    prefetched into L2 ahead of their tile loads (prefetcht1, never into L1); a runtime B,
    packed by the kernel into its caches, is not."""
    spec = _tile_spec(layout=layout)
    _, asm = compile_assembly(ir_text(spec, SAPPHIRE), SAPPHIRE)
    for op in ("ldtilecfg", "tdpbf16ps", "tilerelease", "tileloadd", "tilestored"):
        assert re.search(rf"\b{op}\b", asm), op
    assert len(re.findall(r"\btdpbf16ps\b", asm)) % 4 == 0   # whole 2 x 2 steps
    _assert_eight_tile_registers(asm, "tdpbf16ps")
    spills = re.findall(r"tile(?:stored|loadd)\s+[^\n]*(?:\(%rsp|-\d+\(%rbp)", asm)
    assert not spills, spills
    assert re.search(r"\btileloaddt1\b", asm) and re.search(r"\btileloadd\b", asm)
    assert ("prefetcht1" in asm) == (layout == "packed")
    assert "prefetcht0" not in asm


@pytest.mark.parametrize("approx,op", [("bf16", "tdpbf16ps"), ("int8", "tdpbsud")])
@pytest.mark.parametrize("m", [32, 0], ids=["32 rows", "any rows"])
def test_native_topk_streams_its_weights(m, approx, op):
    """The fused top-k's screens on tiles (bf16 products, or s8 x rows times u8 weights)
    prefetch their weight panels ahead of their tile loads, as the GEMM streams pre-packed
    weights: every row tile reads all of them."""
    spec = TopkGemmSpec(m, 20000, 128, 10, True, *TOPK_TILE, approx, path="tile")
    _, asm = compile_assembly(ir_text(spec, SAPPHIRE), SAPPHIRE)
    assert re.search(rf"\b{op}\b", asm) and re.search(r"\bprefetcht0\b", asm)
    spills = re.findall(r"tile(?:stored|loadd)\s+[^\n]*(?:\(%rsp|-\d+\(%rbp)", asm)
    assert not spills, spills


@pytest.mark.parametrize("n, k", [(1024, 512), (3072, 384), (4096, 2048), (768, 384),
                                  (300, 850), (50257, 192)])
def test_tile_chunks_grow_where_b_outgrows_l2(n, k):
    """A thread streams its B panels once per chunk of rows: where B (``k`` words a column)
    does not fit L2 a chunk takes up to BIG_CHUNK rows, its packed A and (over several K
    blocks) its partial sums within CHUNK_BYTES; else the chunk's A fits a quarter of L2."""
    l2 = 2 << 20
    blk = blocking.tile_blocking(n, k, l2)
    mr, nr = blocking.TILE_BLOCK
    assert blk.mc % mr == 0 and blk.mc >= mr
    if -(-n // nr) * nr * k * 4 >= l2:
        several = blk.kc < k
        row_bytes = blk.kc * 4 + (-(-n // nr) * nr * 4 if several else 0)
        assert blk.mc * row_bytes <= blocking.CHUNK_BYTES or blk.mc == mr
        grown = blk.mc + mr   # as many rows as the bounds allow
        assert grown > blocking.BIG_CHUNK or grown * row_bytes > blocking.CHUNK_BYTES
    else:
        assert blk.mc * blk.kc * 4 <= l2 // 4 or blk.mc == mr


def test_emulated_build_has_no_tile_instructions():
    spec = _tile_spec()
    _, asm = compile_assembly(ir_text(spec, EMULATED), EMULATED)
    assert not re.search(r"\b(tdpbf16ps|ldtilecfg|tileloadd|tilerelease)\b", asm)
    assert re.search(r"\bvdpbf16ps\b", asm)


def test_tile_path_needs_a_target_with_tiles():
    spec = _tile_spec()
    with pytest.raises(ValueError, match="tile path"):
        emit(spec, make_target("sapphirerapids", tiles=""))


def test_tile_modes_key_the_cache_apart():
    keys = {cache.entry_key(_tile_spec().id, t) for t in (SAPPHIRE, EMULATED)}
    assert len(keys) == 2


def test_named_cpus_imply_their_tiles():
    assert SAPPHIRE.tiles == "amx" and SAPPHIRE.has("amx-bf16") and SAPPHIRE.has("amx-int8")
    assert make_target("graniterapids").has("amx-fp16")
    zen4 = make_target("znver4")
    assert zen4.tiles == "" and not zen4.has("amx-tile") and zen4.has("avx512vnni")
    assert blocking.choose(200, 300, 400, zen4, dtype="bf16").path == "vector"
    assert blocking.choose(4, 300, 400, SAPPHIRE, dtype="bf16").path == "vector"  # decode
    with pytest.raises(ValueError, match="AVX-512"):
        tile_mode(make_target("znver3").features, "emulate")
    with pytest.raises(ValueError, match="KWKER_TILES"):
        tile_mode(SAPPHIRE.features, "sometimes")


def test_refused_permission_means_no_tiles(monkeypatch):
    """An old kernel or a sandbox refuses arch_prctl: no tile kernel, and the reason is kept."""
    import errno

    monkeypatch.setattr(tile_permission, "_arch_prctl", lambda code, arg: (-1, errno.EPERM))
    tile_permission._forget()
    try:
        assert tile_mode(SAPPHIRE.features, "", own=True) == ""
        assert "refused" in tile_permission.refusal()
        assert "Operation not permitted" in tile_permission.refusal()
        assert tile_mode(SAPPHIRE.features, "", own=False) == "amx"  # another machine's target
    finally:
        monkeypatch.undo()
        tile_permission._forget()


def test_refused_permission_stops_tile_code_only_on_an_amx_host(monkeypatch):
    """Under a KWKER_CPU naming an AMX CPU, a host with AMX that was refused the tile state
    builds no kernel (it would die of SIGILL); a host without AMX loads the code, as packaging
    does to compile another CPU's kernels, and never calls it."""
    import errno

    from kwker.runtime import kernel as kernel_mod

    spec = GemmSpec(3, 8, 5, 1, "packed", mr=3, nr=16, kc=5, mc=3, nb=1, a_pack=False)
    monkeypatch.setattr(tile_permission, "_arch_prctl", lambda code, arg: (-1, errno.EPERM))
    monkeypatch.setattr(kernel_mod, "host_target", lambda: SAPPHIRE)
    tile_permission._forget()
    try:
        monkeypatch.setattr(kernel_mod, "host_has_amx", lambda: True)
        with pytest.raises(RuntimeError, match="KWKER_TILES=off"):
            kernel_mod.get_kernel(spec)
        monkeypatch.setattr(kernel_mod, "host_has_amx", lambda: False)
        assert kernel_mod.get_kernel(spec) > 0
    finally:
        kernel_mod._kernels.pop(spec, None)  # SAPPHIRE's code: never to be called here
        monkeypatch.undo()
        tile_permission._forget()


BF16X3_CHECK = """
import torch, torch.nn.functional as F
from kwker.kernels.linear import make_linear
torch.manual_seed(4)
n, k = 96, 77                                       # 3K = 231: odd, padded to whole pairs
w, b = torch.randn(n, k), torch.randn(n)
for m in (40, None):
    rows = m or 13
    x, res = torch.randn(rows, k), torch.randn(rows, n)
    exact = F.gelu(x.double() @ w.double().T + b.double()) + res.double()
    scale = exact.abs().max()
    torch.set_float32_matmul_precision("high")
    fn = make_linear(w, b, m, "gelu", residual=True)
    assert (fn.spec.path, fn.spec.dtype, fn.spec.k) == ("tile", "bf16", 232), fn.spec
    errors = {}
    for setting in ("high", "medium", "highest"):
        torch.set_float32_matmul_precision(setting)
        errors[setting] = ((fn(x, res).double() - exact).abs().max() / scale).item()
    rounded = F.gelu(x.bfloat16().double() @ w.bfloat16().double().T + b.double()) + res.double()
    bf16 = ((rounded - exact).abs().max() / scale).item()
    # ~16 bits: far below bf16's rounding, above float32's; "medium" allows it too
    assert 1e-6 < errors["high"] < 2e-5 and errors["high"] < bf16 / 100, (m, errors, bf16)
    assert errors["medium"] == errors["high"] and errors["highest"] < 1e-6, (m, errors)
print("bf16x3 ok")
"""


@pytest.mark.parametrize("tiles", ["emulate", "auto"])
def test_float32_linear_on_bf16x3_tiles_under_high(tiles, tmp_path):
    """``torch.set_float32_matmul_precision("high")`` allows torch's bf16x3 form (x and W each
    two bf16 halves, three products): on bf16 tiles a float32 linear takes it as one bf16 GEMM
    over K three times over, within ~16 bits of the float64 result; "medium" keeps it, at
    "highest" the same callable is float32 again. Emulated tiles on any AVX-512 CPU; the tile
    unit where the CPU has AMX."""
    if tiles == "emulate" and not _has_avx512():
        pytest.skip(f"emulated tiles run as AVX-512 code; this CPU: {host_target().describe()}")
    if tiles == "auto" and host_target().tiles != "amx":
        pytest.skip(f"no AMX tiles on this CPU ({host_target().describe()}): emulated above")
    env = dict(os.environ, KWKER_TILES=tiles, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", BF16X3_CHECK], env=env, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0 and "bf16x3 ok" in r.stdout, r.stdout + r.stderr


def test_instruction_paths_name_what_runs():
    """What the report and the benchmarks call each kernel's instructions, per target."""
    tile, vector = _tile_spec(), GemmSpec(200, 300, 402, 1, "packed", dtype="bf16")
    assert instruction_path(tile, SAPPHIRE) == "amx"
    assert instruction_path(tile, EMULATED) == "amx-emulated"
    assert instruction_path(vector, make_target("znver4")) == "avx512-bf16"
    assert instruction_path(vector, make_target("skylake-avx512")) == "avx512"
    assert instruction_path(vector, make_target("haswell")) == "avx2"
    assert instruction_path(GemmSpec(200, 300, 400), make_target("znver4")) == "avx512"


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(*sys.argv[2:4]))
