"""The low-bit prefill paths (many x rows): weights dequantised panel by panel, x's byte planes
on the u8s8 GEMM (emulated tiles and ``vpdpbusd``), int4's grouped panels and bf16 products
where allowed, against torchao's dequantised weights.
"""
import os
import subprocess
import sys

import pytest
import torch

torchao = pytest.importorskip("torchao")

from kwker.kernels.linear_lowbit import PREFILL_ROWS, lowbit_weight, make_linear_lowbit
from kwker.runtime.target import host_target

from .lowbit_helpers import assert_close, quantized, reference


@pytest.mark.parametrize("fmt, k", [("int8-channel", 192), ("int4-group64-asym", 192),
                                    ("int4-group32", 160)])
def test_prefill_planes_in_blocks_of_weight_rows(fmt, k, monkeypatch):
    """On x's byte planes, weights too large to pack whole go by blocks of W rows (shrunk here
    to blocks of 64 or 96 rows and a tail): each block's scales, zero points, bias, residual
    columns and output columns are its own; with an epilogue, specialised and generic over
    rows."""
    import kwker.kernels.linear_lowbit_prefill as prefill
    from kwker.codegen.gemm_lowbit_planes import NR, grouped_words
    dtype = torch.float32
    lin = quantized(fmt, 230, k, dtype)
    rows = PREFILL_ROWS + 3
    panels = [s for s in make_linear_lowbit(lin.weight, None, rows, dtype=dtype).specs
              if s.family == "lowbit_panels"]
    if not panels:
        pytest.skip(f"{fmt} prefill does not go by byte planes on this CPU "
                    f"({host_target().describe()})")
    # bytes a W row takes in the panels of x's byte planes
    row_bytes = grouped_words(k, panels[0].plane_bits) * 4 // NR if fmt.startswith("int4") \
        else -(-k // 64) * 64
    monkeypatch.setattr(prefill, "PREFILL_WHOLE", 0)
    monkeypatch.setattr(prefill, "PREFILL_BLOCK", 64 * row_bytes)
    for m in (rows, None):
        x, res = torch.randn(rows, k).to(dtype), torch.randn(rows, 230).to(dtype)
        fn = make_linear_lowbit(lin.weight, lin.bias.detach(), m, "gelu", True, dtype)
        tail, block = sorted(s.n for s in fn.specs if s.family == "lowbit_panels")
        assert block in (64, 96) and tail == 230 % block, fn.specs
        assert_close(fn(x, res), reference(lin, x, "gelu", res, dtype), dtype, f"{fmt} {m}")


FUSED = [("int8-channel", torch.float32, 1000), ("int8-channel", torch.bfloat16, 777),
         ("int8-group32", torch.float32, 1056), ("intx8-axis", torch.bfloat16, 1056),
         ("int4-group32", torch.float32, 1056), ("int4-group64-asym", torch.bfloat16, 1088),
         ("int4-group128", torch.float32, 1152), ("int4-axis", torch.float32, 777),
         ("int8-channel", torch.bfloat16, 2401), ("int4-group32", torch.bfloat16, 2400)]


@pytest.mark.parametrize("fmt, dtype, k", FUSED, ids=[f"{f}-{str(d)[6:]}-{k}" for f, d, k in FUSED])
def test_prefill_dequantises_panel_by_panel(fmt, dtype, k, monkeypatch):
    """The GEMM's driver dequantises the weights panel by panel as it packs them (GemmSpec.b_bits),
    on the vector path and on bf16 tiles: no whole float copy. K over one K block (int4:
    blocks of whole chunks, then a tail) and odd in bf16, also over K blocks (the pad element
    after K is zeroed in a buffer the earlier blocks filled); N not whole panels; rows in one
    chunk, in two (generic, 300 rows), and fewer than a tile; GELU and a residual. (float32
    with int8 per channel goes by byte planes where the CPU has VNNI: switched off here.)"""
    import kwker.kernels.linear_lowbit_prefill as prefill
    monkeypatch.setattr(prefill, "_planes", lambda spec: False)
    n = 230
    lin = quantized(fmt, n, k, dtype)
    for m, counts in ((PREFILL_ROWS + 3, [PREFILL_ROWS + 3]), (None, [PREFILL_ROWS, 45, 300])):
        fn = make_linear_lowbit(lin.weight, lin.bias.detach(), m, "gelu", True, dtype)
        families = {s.family for s in fn.specs}
        gemms = [s for s in fn.specs if s.family == "gemm"]
        assert families <= {"gemm", "gemm_lowbit"} and [s.b_bits for s in gemms] == [
            lowbit_weight(lin.weight).bits], fn.specs
        for rows in counts:
            x, res = torch.randn(rows, k).to(dtype), torch.randn(rows, n).to(dtype)
            assert_close(fn(x, res), reference(lin, x, "gelu", res, dtype), dtype,
                         f"{fmt} {m} {rows}")


def test_bf16_prefill_on_emulated_tiles(tmp_path):
    """The bf16 cases above on emulated tiles (AVX-512 code of the tile instructions' semantics),
    where the prefill's product runs on the tile path as on a CPU with AMX: its driver
    dequantises the low-bit panels as it packs them there too."""
    if host_target().vector_bits != 512:
        pytest.skip(f"emulated tiles are AVX-512 code; this CPU: {host_target().describe()}")
    env = dict(os.environ, KWKER_TILES="emulate", KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", __file__, "-k",
                        "dequantises_panel_by_panel and bfloat16"],
                       env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]


def _skip_without_vnni() -> None:
    if not (host_target().vector_bits == 512 and host_target().has("avx512vnni")):
        pytest.skip(f"the byte planes' u8s8 GEMM needs AVX-512 with VNNI (emulated tiles "
                    f"too); this CPU: {host_target().describe()}")


def _run_check(script: str, tiles: str, tmp_path) -> subprocess.CompletedProcess:
    """``script`` in a fresh process with ``KWKER_TILES=tiles`` and a kernel cache of its own."""
    env = dict(os.environ, KWKER_TILES=tiles, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, check=False)


# the rows the byte planes hand back to the float path (zero, tiny, NaN, inf, huge) among
# ordinary ones, through GELU and a residual, against the float64 reference
CHECK_ROWS = """
import torch
import torch.nn.functional as F
from kwker.kernels.linear_lowbit import LowbitTensor, dequantized, make_linear_lowbit


def check_rows(fn, w, bias, m):
    n, k = w.shape
    x, res = torch.randn(20, k) * 2, torch.randn(20, n)
    x[3] = 0.0
    x[4] *= 1e-37
    x[5, k - 1] = float("nan")
    x[6, 0] = float("inf")
    x[7] *= 1e30
    x[8] = 2.0          # constant rows: every product of a weight row of one sign adds up
    x[9] = -x[8]
    ref = F.gelu(F.linear(x.double(), dequantized(w).double(), bias.double()),
                 approximate="tanh") + res.double()
    y = fn(x, res)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    for i in range(20):
        if ref[i].isfinite().all():
            err = (y[i].double() - ref[i]).abs().max() / ref[i].abs().max()
            assert err < 1e-5, (n, k, m, i, float(err))
"""


PLANES_CHECK = CHECK_ROWS + """
torch.manual_seed(1)
for n, k in ((70, 77), (100, 256), (33, 1000)):
    w = LowbitTensor(torch.randint(-128, 128, (n, k), dtype=torch.int8),
                     torch.rand(n, 1) * 0.01 + 1e-3, None, k, 8, torch.float32)
    bias = torch.randn(n)
    for m in (20, None):
        fn = make_linear_lowbit(w, bias, m, "gelu_tanh", True)
        # the planes combined in the GEMM's epilogue, on the tiles as on the vector path
        fams = [s.family for s in fn.specs]
        fused = [s.planes for s in fn.specs if s.family == "gemm"]
        assert "lowbit_planes" in fams and fused == [3], fn.specs
        check_rows(fn, w, bias, m)
# float32 products below full precision allowed: two planes, x to 2**-15 of its row's largest
# |x| (bound per element: half a step of 2**(E - 14), 2**(E - 1) <= max|x| < 2**E)
torch.set_float32_matmul_precision("high")
for n, k in ((70, 1000), (33, 3000)):
    w = LowbitTensor(torch.randint(-128, 128, (n, k), dtype=torch.int8),
                     torch.rand(n, 1) * 0.01 + 1e-3, None, k, 8, torch.float32)
    fn = make_linear_lowbit(w, None, 20)
    assert {s.planes for s in fn.specs if s.family == "lowbit_planes"} == {2}, fn.specs
    deq = dequantized(w).double()
    x = torch.randn(20, k)
    ref = x.double() @ deq.T
    exp = torch.floor(torch.log2(x.abs().amax(1).double())) + 1
    bound = 2.0 ** (exp - 15)[:, None] * deq.abs().sum(1)[None] + 1e-6 * ref.abs().max()
    err = (fn(x).double() - ref).abs()
    assert (err <= bound).all() and err.max() > 1e-6 * ref.abs().max(), (n, k, float(err.max()))
    x[3, 0] = 1000.0   # one row's outlier (~30x its rms): two planes coarser than TF32, so three
    ref = x.double() @ deq.T
    err = (fn(x).double() - ref).abs().amax(1) / ref.abs().amax(1)
    assert err.max() < 1e-5, (n, k, float(err.max()))
torch.set_float32_matmul_precision("highest")
print("planes ok on", sorted({s.path for s in fn.specs if s.family == "gemm"}))
"""



@pytest.mark.parametrize("tiles, path", [("emulate", "tile"), ("off", "vector")])
def test_int8_prefill_on_byte_planes(tiles, path, tmp_path):
    """float32 prefill with int8 weights per channel on x's byte planes and the u8s8 GEMM: on
    the emulated tiles, and on vpdpbusd (the CPUs with AVX512_VNNI and no tiles; tiles off
    here), both on any AVX-512 CPU with VNNI. Every row agrees with the float64 reference to
    float32 error, the rows the planes hand back (zero, tiny, NaN, inf) included, with GELU and
    a residual; K odd, under a tile step, over a K block. Under
    ``torch.set_float32_matmul_precision("high")``: two planes, within x's rounding to 2**-15 of
    its row's largest |x|, and three again for a call where a row's outlier would make two
    coarser than TF32."""
    _skip_without_vnni()
    r = _run_check(PLANES_CHECK, tiles, tmp_path)
    assert r.returncode == 0 and f"planes ok on ['{path}']" in r.stdout, r.stdout + r.stderr


PLANES4_CHECK = CHECK_ROWS + """
torch.manual_seed(3)
for n, k, group, asym in ((70, 96, 32, True), (100, 256, 64, False), (33, 1000, 1000, True),
                          (40, 3072, 32, False), (45, 4992, 32, True), (40, 3072, 128, False),
                          (30, 200, 200, False)):
    g = -(-k // group)
    zp = torch.randint(-8, 8, (n, g), dtype=torch.int8) if asym else None
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    q[0], q[1] = -8, 7      # with x's constant rows, each group's sums as large as they get
    w = LowbitTensor(q, torch.rand(n, g) * 0.01 + 1e-3, zp, group, 4, torch.float32)
    bias = torch.randn(n)
    for m in (20, None):
        fn = make_linear_lowbit(w, bias, m, "gelu_tanh", True)
        grouped = [s for s in fn.specs if s.family == "gemm" and s.planes]
        scale_k = [s.group for s in fn.specs if s.family == "gemm_lowbit"][0]
        # symmetric weights on the tiles: two planes of 12-bit digits, their int32 sums run
        # on over a scale's groups of 32 k (up to four)
        assert [(s.plane_bits, s.b_group) for s in grouped] == [
            (12, scale_k) if s.path == "tile" and not asym else (8, 32) for s in grouped], \
            fn.specs
        check_rows(fn, w, bias, m)
torch.set_float32_matmul_precision("high")   # two planes
w = LowbitTensor(torch.randint(-8, 8, (33, 2976), dtype=torch.int8),
                 torch.rand(33, 93) * 0.01 + 1e-3, None, 32, 4, torch.float32)
fn = make_linear_lowbit(w, None, 20)
x = torch.randn(20, 2976)
deq = dequantized(w).double()
ref = x.double() @ deq.T
exp = torch.floor(torch.log2(x.abs().amax(1).double())) + 1
bound = 2.0 ** (exp - 15)[:, None] * deq.abs().sum(1)[None] + 1e-6 * ref.abs().max()
err = (fn(x).double() - ref).abs()
assert {s.planes for s in fn.specs if s.family == "lowbit_planes"} == {2}, fn.specs
if {s.plane_bits for s in fn.specs if s.family == "gemm"} == {12}:   # exact, as three of 8
    assert err.max() < 1e-5 * ref.abs().max(), float(err.max())
else:
    assert (err <= bound).all() and err.max() > 1e-6 * ref.abs().max(), float(err.max())
print("int4 planes ok on", sorted({s.path for s in fn.specs if s.family == "gemm"}))
"""


@pytest.mark.parametrize("tiles, path", [("emulate", "tile"), ("off", "vector")])
def test_int4_prefill_on_byte_planes(tiles, path, tmp_path):
    """float32 prefill with int4 weights in groups (of 32, 64, 128, one per row), symmetric or
    with zero points, on x's byte planes: on the emulated int8 tiles (a group a tile step,
    gemm_tile_grouped.py) and on vpdpbusd (AVX512_VNNI without tiles; tiles off here), both on
    any AVX-512 CPU with VNNI. int32 sums per 32 k, scaled per group; on the tiles, 12-bit
    planes sum a scale's groups before they are combined, exact where the combined sum of 128 k
    passes int32 (constant x rows against weight rows all -8 or all 7). Every row agrees with the
    float64 reference to float32 error, the rows the planes hand back included, with GELU and a
    residual; K odd, over a K block (two on the tiles: 4992 k). Two planes under
    ``torch.set_float32_matmul_precision("high")``, within x's rounding to 2**-15 of its row's
    largest |x|."""
    _skip_without_vnni()
    r = _run_check(PLANES4_CHECK, tiles, tmp_path)
    assert r.returncode == 0 and f"int4 planes ok on ['{path}']" in r.stdout, \
        r.stdout + r.stderr


@pytest.mark.parametrize("n, k", [(70, 77), (33, 1000), (64, 256), (1, 3)])
def test_int8_panels_packed_per_call_equal_the_tile_packer(n, k):
    """The prefill's per-call packing kernel lays int8 weights out as the u8s8 tile GEMM's own
    packer does (quad words, 32-column panels, zero past N and K), word for word."""
    from kwker.codegen.gemm_lowbit_planes import NR, panel_words
    from kwker.kernels._call import entry
    from kwker.kernels.linear_int8 import pack_int8_panels
    from kwker.kernels.specs import LowbitPanelsSpec
    torch.manual_seed(5)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    out = torch.full((-(-n // NR) * NR * panel_words(k),), -1, dtype=torch.int32)
    entry(LowbitPanelsSpec(n, k), 2)(w.data_ptr(), out.data_ptr(), 2)
    assert torch.equal(out, pack_int8_panels(w, NR).flatten())


def test_int4_kernels_of_one_weight_share_its_packing_and_free_it():
    """The decode kernels, the prefill and the kernels of a few or any rows of one int4 weight
    read one packed copy (three compiled graphs held three; the dynamic-rows kernels packed
    blocks of their own); it goes when the weight goes. 67 rows: the last block's 3 rows."""
    import gc

    import kwker.kernels.linear_lowbit as lowbit
    lin = quantized("int4-group32", 67, 256)
    a = make_linear_lowbit(lin.weight, None, 1)
    b = make_linear_lowbit(lin.weight, None, 1, "relu")
    c = make_linear_lowbit(lin.weight, lin.bias.detach(), PREFILL_ROWS + 5)
    d = make_linear_lowbit(lin.weight, lin.bias.detach(), None)
    e = make_linear_lowbit(lin.weight, lin.bias.detach(), 3)
    assert len({f.buffers.w.data_ptr() for f in (a, b, c, d, e)}) == 1
    x = torch.randn(PREFILL_ROWS + 5, 256)
    assert_close(c(x), reference(lin, x), torch.float32)
    assert_close(e(x[:3]), reference(lin, x[:3]), torch.float32)
    for rows in (1, 2, 3, 4, 5, 7, PREFILL_ROWS - 1, PREFILL_ROWS + 5):
        assert_close(d(x[:rows]), reference(lin, x[:rows]), torch.float32)
    entries = len(lowbit._OPERANDS)
    del lin, a, b, c, d, e
    gc.collect()
    assert len(lowbit._OPERANDS) < entries


BF16_PRODUCTS_CHECK = """
import torch
from kwker.kernels import blocking
from kwker.kernels.linear_lowbit import PREFILL_ROWS, LowbitTensor, dequantized, make_linear_lowbit
from kwker.runtime.target import host_target
torch.manual_seed(3)
fast = bool(host_target().tiles) or not blocking.widens_bf16()
n, rows = 100, PREFILL_ROWS * 2
for k, group in ((256, 32), (255, 255)):                # k odd: x padded to whole pairs
  w = LowbitTensor(torch.randint(-8, 8, (n, k), dtype=torch.int8),
                   torch.rand(n, k // group) * 0.01 + 1e-3, None, group, 4, torch.float32)
  bias, x, res = torch.randn(n), torch.randn(rows, k), torch.randn(rows, n)
  exact = x.double() @ dequantized(w).double().T + bias.double() + res.double()
  rounded = x.bfloat16().double() @ dequantized(w).bfloat16().double().T + bias.double() + \
      res.double()
  for m in (rows, None):
    fn = make_linear_lowbit(w, bias, m, residual=True)
    for precision, ref in (("medium", rounded if fast else exact), ("highest", exact)):
        torch.set_float32_matmul_precision(precision)
        y = fn(x, res)
        assert y.dtype == torch.float32
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (k, m, precision, err)
        far = ((y.double() - exact).abs().max() / exact.abs().max()).item()
        assert (far > 1e-4) == (precision == "medium" and fast), (k, m, precision, far)
from kwker.runtime.kernel import _kernels
bf16_out = {s.path for s in _kernels if s.family == "gemm" and s.out == "f32"}
print("bf16 products ok:", sorted(bf16_out))
"""


@pytest.mark.parametrize("tiles", ["off", "emulate"])
def test_int4_prefill_on_bf16_products_where_allowed(tiles, tmp_path):
    """``torch.set_float32_matmul_precision("medium")`` allows bf16 products for float32
    matmuls (as oneDNN reads it): where the CPU has them fast (``vdpbf16ps``, or bf16 tiles:
    emulated here on AVX-512), float32 x with int4 weights then takes them, x and the
    dequantised weights rounded to bf16, the sums, bias and residual in float32, the output
    float32. The setting is read per call: back at "highest" the same kernel is exact again.
    Without fast bf16 products (bf16 widened to float32 FMAs) the product stays exact."""
    from kwker.kernels import blocking
    if tiles == "emulate" and host_target().vector_bits != 512:
        pytest.skip(f"emulated tiles run as AVX-512 code; this CPU: {host_target().describe()}")
    r = _run_check(BF16_PRODUCTS_CHECK, tiles, tmp_path)
    assert r.returncode == 0 and "bf16 products ok" in r.stdout, r.stdout + r.stderr
    paths = {"emulate": "['tile']", "off": "[]" if blocking.widens_bf16() else "['vector']"}
    assert f"bf16 products ok: {paths[tiles]}" in r.stdout, r.stdout


@pytest.mark.parametrize("n, k, group, asym, bits", [
    (70, 77, 32, True, 8), (33, 1000, 64, False, 8), (64, 256, 128, True, 8), (5, 40, 32, False, 8),
    (70, 77, 32, False, 12), (33, 1000, 64, False, 12), (5, 40, 32, False, 12)])
def test_int4_grouped_panels_hold_the_weights_their_sums_and_scales(n, k, group, asym, bits):
    """The int4 prefill's per-call packer (codegen/gemm_lowbit_planes.py): from the decode's
    nibble layout to 32-column panels of ``q - zp`` quad words per 32 k (``bits`` 12: words of
    two k as ``(q, 16 q)`` bytes), each group followed by the columns' sums of ``q - zp`` (not
    for 12-bit panels) and their scales; zero past N and K, word for word against a layout made
    here from q."""
    from kwker.codegen import gemm_lowbit
    from kwker.codegen.gemm_lowbit_planes import NR, grouped_words, panel_words
    from kwker.codegen.gemm_tile_grouped import group_rows
    from kwker.kernels._call import entry
    from kwker.kernels.linear_lowbit import pack_int4
    from kwker.kernels.specs import LowbitPanelsSpec
    from kwker.runtime.target import host_target
    if not host_target().has("avx512vnni") or host_target().vector_bits != 512:
        pytest.skip(f"the packer sums on vpdpbusd: AVX-512 with VNNI; this CPU: "
                    f"{host_target().describe()}")
    torch.manual_seed(n + k)
    spec = LowbitPanelsSpec(n, k, 4, group, asym, 8, 16, bits)
    kp, groups = gemm_lowbit.padded_k(spec, 16), gemm_lowbit.groups(spec, 16)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    zp = torch.randint(-8, 8, (n, groups), dtype=torch.int8) if asym else None
    scale = torch.rand(n, groups) + 0.5
    w = pack_int4(q, 16, kp, 8)
    out = torch.full((-(-n // NR) * grouped_words(k, bits),), -1, dtype=torch.int32)
    entry(spec, 4)(w.data_ptr(), scale.data_ptr(), zp.data_ptr() if asym else None,
                   out.data_ptr(), 2)
    kw = panel_words(k)
    cols = -(-n // NR) * NR
    wq = torch.zeros(cols, kw * 4, dtype=torch.int32)
    wq[:n, :k] = q.int() - (zp.int().repeat_interleave(group, 1)[:, :k] if asym else 0)
    groups_k = kw * 4 // 32
    sub = wq.view(cols, groups_k, 8, 4)                   # (column, group, quad, byte)
    if bits == 12:                                        # (column, group, pair, q 16q q 16q)
        pairs = wq.view(cols, groups_k, 16, 2)
        sub = torch.stack([pairs[..., 0], 16 * pairs[..., 0], pairs[..., 1],
                           16 * pairs[..., 1]], -1)
    words = (sub & 255) << torch.tensor([0, 8, 16, 24])
    words = words.sum(-1, dtype=torch.int64).to(torch.int64)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    sums = wq.view(cols, groups_k, 32).sum(2, dtype=torch.int32)
    g = torch.arange(groups_k) * 32 // group
    scales = scale[torch.arange(cols).clamp(max=n - 1)][:, g].view(torch.int32)
    # 12-bit panels hold no sums (their planes carry x's digits without an offset)
    want = torch.cat([words.permute(1, 2, 0)] + ([] if bits == 12 else [sums.T[:, None]])
                     + [scales.T[:, None]], 1)
    want = want.view(groups_k, group_rows(bits), cols // NR, NR).permute(2, 0, 1, 3)
    assert torch.equal(out, want.flatten())
