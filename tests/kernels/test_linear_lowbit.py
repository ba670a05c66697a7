"""Weight-only int8/int4 linears (kernels/linear_lowbit.py) against torchao's dequantised weights.

The reference is ``x @ ((q - zp) * scale).T`` in float64 from torchao's own tensors; float32
activations must agree to float32 accumulation error, bf16 ones to the bf16 rounding of the
output (and, on the prefill path, of the dequantised weight, as eager bf16 rounds it).
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

torchao = pytest.importorskip("torchao")
from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, MappingType, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup

from kwker.kernels.linear_lowbit import PREFILL_ROWS, dequantized, lowbit_weight, make_linear_lowbit
from kwker.runtime import huge_pages
from kwker.runtime.target import host_target

FORMATS = {
    "int8-channel": (Int8WeightOnlyConfig, {}),
    "int8-group32": (Int8WeightOnlyConfig, {"granularity": PerGroup(32)}),
    "intx8-axis": (IntxWeightOnlyConfig, {"weight_dtype": torch.int8,
                                          "granularity": PerAxis(0)}),
    "int4-group32": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                            "granularity": PerGroup(32)}),
    "int4-group64-asym": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                                 "granularity": PerGroup(64),
                                                 "mapping_type": MappingType.ASYMMETRIC}),
    "int4-group64": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                            "granularity": PerGroup(64)}),
    "int4-group128": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                             "granularity": PerGroup(128)}),
    "int4-axis": (IntxWeightOnlyConfig, {"weight_dtype": torch.int4,
                                         "granularity": PerAxis(0)}),
    "int2-group32": (IntxWeightOnlyConfig, {"weight_dtype": torch.int2,
                                            "granularity": PerGroup(32)}),
}
EPILOGUES = {"none": lambda y: y, "relu": F.relu, "silu": F.silu, "gelu": F.gelu,
             "gelu_tanh": lambda y: F.gelu(y, approximate="tanh")}


def quantized(fmt: str, n: int, k: int, dtype=torch.float32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n).to(dtype)
    config, kwargs = FORMATS[fmt]
    quantize_(lin, config(**kwargs))
    return lin


def reference(lin: nn.Linear, x, epilogue="none", res=None, dtype=torch.float32):
    w = dequantized(lin.weight).double()
    y = x.double() @ w.T + lin.bias.detach().to(dtype).double()
    y = EPILOGUES[epilogue](y)
    return y if res is None else y + res.double()


def assert_close(y, ref, dtype, what=""):
    assert y.dtype == dtype and y.shape == ref.shape, what
    scale = ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    bound = 1e-5 if dtype == torch.float32 else 2 ** -7   # bf16: output (and weight) rounding
    assert err <= bound * scale, f"{what}: error {err:g} against max |ref| {scale:g}"


def shape_for(fmt):
    return (37, 70) if fmt.endswith(("channel", "axis")) else (100, 256)


CASES = [(fmt, torch.float32) for fmt in sorted(FORMATS)] + \
    [(fmt, torch.bfloat16) for fmt in ("int8-channel", "int4-group64-asym", "int4-axis")]


@pytest.mark.parametrize("fmt, dtype", CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in CASES])
def test_each_format_every_row_count(fmt, dtype):
    """The decode tile of one row, a full tile of 4 and its leftover (5 = 4 + 1), the prefill
    path and the kernel generic over rows (tiles of 3) at counts on both sides of the switch."""
    n, k = shape_for(fmt)
    lin = quantized(fmt, n, k, dtype)
    lw = lowbit_weight(lin.weight)
    assert lw.bits == (4 if fmt.startswith(("int4", "int2")) else 8)
    for m in (1, 5, PREFILL_ROWS + 3, None):
        fn = make_linear_lowbit(lin.weight, lin.bias.detach(), m, dtype=dtype)
        for rows in ([m] if m else [1, 2, 7, PREFILL_ROWS, 40]):
            x = torch.randn(rows, k).to(dtype)
            assert_close(fn(x), reference(lin, x, dtype=dtype), dtype, f"{fmt} m={m} {rows}")


@pytest.mark.parametrize("epilogue", sorted(EPILOGUES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_epilogues_and_residual(epilogue, dtype):
    """Every epilogue with a residual, on the decode kernel (1 row) and the kernel generic over
    rows at a decode and a prefill count."""
    lin = quantized("int4-group32", 72, 128, dtype)
    for m, rows in ((1, 1), (None, 2), (None, PREFILL_ROWS + 1)):
        x, res = torch.randn(rows, 128).to(dtype), torch.randn(rows, 72).to(dtype)
        fn = make_linear_lowbit(lin.weight, lin.bias.detach(), m, epilogue, True, dtype)
        assert_close(fn(x, res), reference(lin, x, epilogue, res, dtype), dtype, epilogue)


@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (3, PREFILL_ROWS)])
def test_leading_dims_taken_as_they_are(lead):
    """``lead``: a decoder's (1, 1, K) token, or a (batch, seq, K) prompt, in and out without a
    reshape (decode and prefill kernels), a residual of the output's shape; another shape is
    refused with the one expected."""
    lin = quantized("int4-group32", 72, 128)
    m = lead[0] * lead[1]
    for residual in (False, True):
        fn = make_linear_lowbit(lin.weight, lin.bias.detach(), m, "gelu", residual, lead=lead)
        x, res = torch.randn(*lead, 128), torch.randn(*lead, 72)
        y = fn(x, res) if residual else fn(x)
        assert_close(y, reference(lin, x, "gelu", res if residual else None), torch.float32)
        with pytest.raises(ValueError, match="expected shape"):
            fn(x.reshape(m, 128), res.reshape(m, 72)) if residual else fn(x.reshape(m, 128))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_generic_kernel_takes_any_leading_dims(dtype):
    """The kernel generic over rows (``m=None``) takes x of any leading dims and gives the
    output with them, as ``F.linear``: a decoder's (1, 1, K) token and (batch, seq, K) prompts
    on both sides of the prefill switch, a 1-D x, a non-contiguous one; a residual of another
    shape is refused with the one expected."""
    lin = quantized("int8-channel", 72, 128, dtype)
    f = make_linear_lowbit(lin.weight, lin.bias.detach(), None, "gelu", True, dtype)
    g = make_linear_lowbit(lin.weight, lin.bias.detach(), None, dtype=dtype)
    for lead in ((1, 1), (2, 3), (3, PREFILL_ROWS), (0, 3), ()):
        x, res = torch.randn(*lead, 128).to(dtype), torch.randn(*lead, 72).to(dtype)
        for xs in (x, x.transpose(0, -1).contiguous().transpose(0, -1)):
            y = f(xs, res)
            assert y.shape == (*lead, 72) and y.dtype == dtype
            if x.numel():
                assert_close(y, reference(lin, x, "gelu", res, dtype), dtype, str(lead))
        assert g(x).shape == (*lead, 72)
        if x.numel():
            assert_close(g(x), reference(lin, x, dtype=dtype), dtype, str(lead))
    with pytest.raises(ValueError, match="expected shape"):
        f(torch.randn(2, 3, 128).to(dtype), torch.randn(3, 2, 72).to(dtype))


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
    import os
    import subprocess
    import sys
    if host_target().vector_bits != 512:
        pytest.skip(f"emulated tiles are AVX-512 code; this CPU: {host_target().describe()}")
    env = dict(os.environ, KWKER_TILES="emulate", KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-p", "no:randomly", __file__, "-k",
                        "dequantises_panel_by_panel and bfloat16"],
                       env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 0 and " passed" in r.stdout and "skipped" not in r.stdout, \
        r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.parametrize("fmt", ["int8-group32", "int4-group64-asym", "int8-channel"])
@pytest.mark.parametrize("rows", [1, 3, PREFILL_ROWS + 2])
def test_nan_and_inf_activations(fmt, rows):
    """NaN and +-inf in x give NaN and +-inf where the dequantised product does (inf times a
    weight of 0 is NaN)."""
    n, k = shape_for(fmt)
    lin = quantized(fmt, n, k)
    x = torch.randn(rows, k)
    x[0, 5] = float("inf")
    if rows > 1:
        x[1, 3], x[rows - 1, k - 1] = float("nan"), float("-inf")
    y = make_linear_lowbit(lin.weight, lin.bias.detach(), rows)(x)
    ref = reference(lin, x)
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    assert torch.equal(y[y.isinf()], ref[ref.isinf()].float())
    finite = ref.isfinite()
    if finite.any():
        assert_close(y[finite], ref[finite], torch.float32, fmt)


@pytest.mark.parametrize("fmt", ["int4-group32", "int4-group64-asym", "int4-axis"])
@pytest.mark.parametrize("rows", [1, 3])
def test_activations_near_overflow(fmt, rows):
    """Finite x whose products with the raw nibbles (up to 15 x) overflow float32: the int4 tiles
    that fold the zero-point term out (AVX2) must not take them."""
    n, k = shape_for(fmt)
    lin = quantized(fmt, n, k)
    x = torch.randn(rows, k)
    x[rows - 1, 7] = 3e37
    y = make_linear_lowbit(lin.weight, lin.bias.detach(), rows)(x)
    ref = reference(lin, x)
    assert ref.abs().max() < 3e38 and torch.isfinite(y).all()
    assert_close(y, ref, torch.float32, fmt)


@pytest.mark.parametrize("fmt", ["int4-group32", "int4-group64-asym"])
@pytest.mark.parametrize("rows", [1, 3])
def test_tiny_activations(fmt, rows):
    """x of about 1e-36 (normal floats): the folded int4 tiles (AVX2) scale x by up to 16**-6,
    which would make such x subnormal and lose its digits, so they must not take them."""
    n, k = shape_for(fmt)
    lin = quantized(fmt, n, k)
    with torch.no_grad():
        lin.bias.zero_()
    x = torch.randn(rows, k) * 1e-36
    y = make_linear_lowbit(lin.weight, None, rows)(x)
    assert_close(y, reference(lin, x), torch.float32, fmt)


@pytest.mark.parametrize("fmt", ["int8-channel", "intx8-axis", "int4-axis"])
@pytest.mark.parametrize("rows", [1, 3])
def test_k_shorter_than_a_vector(fmt, rows):
    """K of 5: the only group ends inside the first vector (no whole vector to sweep)."""
    lin = quantized(fmt, 9, 5)
    x = torch.randn(rows, 5)
    assert_close(make_linear_lowbit(lin.weight, lin.bias.detach(), rows)(x), reference(lin, x),
                 torch.float32, fmt)


def test_int8_weights_are_read_in_place():
    """int8 values stay torchao's (no copy: moved onto huge pages, the same tensor with the
    same values); int4 ones are repacked at half their bytes."""
    lin8 = quantized("int8-group32", 64, 256)
    qdata = lin8.weight.qdata
    values, x = qdata.clone(), torch.randn(1, 256)
    before = reference(lin8, x)
    fn8 = make_linear_lowbit(lin8.weight, None, 1)
    assert lin8.weight.qdata is qdata and torch.equal(qdata, values)
    assert fn8.buffers.w.data_ptr() == qdata.data_ptr()
    assert getattr(qdata.untyped_storage(), huge_pages.MOVED, False)
    assert torch.equal(reference(lin8, x), before)   # torchao's own path reads the moved values
    lin4 = quantized("int4-group32", 64, 256)
    fn4 = make_linear_lowbit(lin4.weight, None, 1)
    assert fn4.buffers.w.numel() * fn4.buffers.w.element_size() == 64 * 256 // 2


def test_unsupported_formats_say_why():
    lin = quantized("int8-channel", 32, 64)
    with pytest.raises(NotImplementedError, match="not a torchao weight"):
        lowbit_weight(torch.randn(32, 64))
    with pytest.raises(NotImplementedError, match="runs in float32 or bfloat16"):
        make_linear_lowbit(lin.weight, None, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="bias must be"):
        make_linear_lowbit(lin.weight, torch.zeros(3), 1)
    fn = make_linear_lowbit(lin.weight, None, 2)
    with pytest.raises(ValueError, match="built for 2 rows"):
        fn(torch.randn(3, 64))
    with pytest.raises(ValueError, match="expected shape"):
        fn(torch.randn(2, 65))
    x = torch.randn(64, 2).t()           # not contiguous: read as a contiguous copy
    assert torch.equal(fn(x), fn(x.contiguous()))
    with_res = make_linear_lowbit(lin.weight, None, 2, residual=True)
    with pytest.raises(ValueError, match="expected shape"):
        with_res(torch.randn(2, 64), torch.randn(2, 31))
    res = torch.randn(32, 2).t()
    assert torch.equal(with_res(x, res), with_res(x.contiguous(), res.contiguous()))


def _packed_int4_reference(q: torch.Tensor, lanes: int, kp: int, rr: int) -> torch.Tensor:
    """gemm_lowbit.py's nibble layout made in torch, word by word from its definition: per
    chunk of ``8 * lanes`` weights of a row, weight ``j * lanes + l`` in nibble ``j`` of word
    ``l`` as ``q + 8``; rows in blocks of ``rr``, their chunks interleaved; 8 past K and N."""
    n, k = q.shape
    rows = -(-n // rr) * rr
    u = torch.full((rows, kp), 8, dtype=torch.int64)
    u[:n, :k] = q.long() + 8
    nib = u.view(rows, kp // (8 * lanes), 8, lanes)                  # (row, chunk, j, lane)
    words = (nib << (4 * torch.arange(8)).view(1, 1, 8, 1)).sum(2)   # (row, chunk, lane)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).int()
    return words.view(rows // rr, rr, kp // (8 * lanes), lanes).permute(0, 2, 1, 3).reshape(
        rows, kp // 8)


@pytest.mark.parametrize("n,k,kp,rr,lanes", [
    (101, 200, 256, 3, 16), (101, 200, 512, 8, 16), (16, 128, 128, 8, 16), (7, 5, 128, 4, 16),
    (33, 300, 320, 8, 8), (1, 64, 64, 1, 8), (10, 40, 64, 8, 4), (0, 64, 128, 8, 16)])
def test_int4_packing_kernel_equals_the_layout(n, k, kp, rr, lanes):
    """pack_int4's kernel gives the layout's words: N not a multiple of rr, K not of the chunk,
    chunks of padding past K, 4, 8 and 16 lanes (SSE, AVX2, AVX-512), rows read through a
    stride (a view of wider rows), no rows; values outside [-8, 7] refused as before."""
    from kwker.kernels.linear_lowbit import pack_int4
    torch.manual_seed(n + k)
    wide = torch.randint(-8, 8, (n, k + 9), dtype=torch.int8)
    q = wide[:, 3:3 + k]
    got = pack_int4(q, lanes, kp, rr)
    assert torch.equal(got, _packed_int4_reference(q, lanes, kp, rr))
    assert torch.equal(pack_int4(q.contiguous(), lanes, kp, rr), got)
    if n:
        bad = q.clone()
        bad[n // 2, k // 2] = 8
        with pytest.raises(NotImplementedError, match="outside"):
            pack_int4(bad, lanes, kp, rr)


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
    import os
    import subprocess
    import sys

    from kwker.runtime.target import host_target
    if not (host_target().vector_bits == 512 and host_target().has("avx512vnni")):
        pytest.skip(f"the byte planes' u8s8 GEMM needs AVX-512 with VNNI (emulated tiles "
                    f"too); this CPU: {host_target().describe()}")
    env = dict(os.environ, KWKER_TILES=tiles, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", PLANES_CHECK], env=env, capture_output=True,
                       text=True, check=False)
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
    import os
    import subprocess
    import sys

    from kwker.runtime.target import host_target
    if not (host_target().vector_bits == 512 and host_target().has("avx512vnni")):
        pytest.skip(f"the byte planes' u8s8 GEMM needs AVX-512 with VNNI; this CPU: "
                    f"{host_target().describe()}")
    env = dict(os.environ, KWKER_TILES=tiles, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", PLANES4_CHECK], env=env, capture_output=True,
                       text=True, check=False)
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
    import os
    import subprocess
    import sys

    from kwker.kernels import blocking
    from kwker.runtime.target import host_target
    if tiles == "emulate" and host_target().vector_bits != 512:
        pytest.skip(f"emulated tiles run as AVX-512 code; this CPU: {host_target().describe()}")
    env = dict(os.environ, KWKER_TILES=tiles, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", BF16_PRODUCTS_CHECK], env=env,
                       capture_output=True, text=True, check=False)
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
