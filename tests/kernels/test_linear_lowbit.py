"""Weight-only int8/int4 linears (kernels/linear_lowbit.py) against torchao's dequantised weights:
every format and row count, epilogues, leading dims, edge activations, the int4 packing.

The reference is ``x @ ((q - zp) * scale).T`` in float64 from torchao's own tensors; float32
activations must agree to float32 accumulation error, bf16 ones to the bf16 rounding of the
output (and, on the prefill path, of the dequantised weight, as eager bf16 rounds it). The
decode paths per ISA are in test_lowbit_decode_paths.py, the prefill's in
test_lowbit_prefill_paths.py.
"""
import pytest
import torch

torchao = pytest.importorskip("torchao")

from kwker.kernels.linear_lowbit import PREFILL_ROWS, lowbit_weight, make_linear_lowbit
from kwker.runtime import huge_pages

from .lowbit_helpers import EPILOGUES, FORMATS, assert_close, quantized, reference, shape_for

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
