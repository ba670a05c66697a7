"""int4 weights (groups of 32 k or more) times float activations on ``vpdpbusd`` (AVX512_VNNI).

The float path of gemm_lowbit.py spends a shift, a ``vpermps`` lookup and an FMA on every 16
int4 weights, and a decode step's int4 GEMVs were bound by those instructions, not by memory
(Emerald Rapids, GPT-2's 49 linears: int4 at the same weights per second as int8, half the
bytes). Here the weights stay in gemm_lowbit.py's packed layout and are multiplied as bytes.

In a packed chunk (128 k of one W row, 16 words), byte ``b`` of word ``l`` holds ``u = q + 8``
of ``k = 32 b + l`` (low nibble) and ``k = 32 b + 16 + l`` (high nibble): each byte lies in one
32-k block. One ``vpshufb`` transposes every 128-bit lane's 4 x 4 bytes, so that word ``g`` of
lane ``i`` holds the bytes ``b = g`` of words ``4 i .. 4 i + 3``; a mask and a shift then give
two vectors of nibbles in which every 32-bit word covers 4 k of one 32-k block (``32 g + 4 i +
t``, and 16 more). ``vpdpbusd`` multiplies them (unsigned, 0..15) by x's signed byte digits laid
out in the same order, 64 weights an instruction.

x is written once per call as integers, ``x_int = rint(x * 2**(22 - E))`` with ``max|x| <
2**E`` (as for int8, gemm_lowbit_vnni.py), in three signed digits ``x_int = d0 + 2**8 d1 + 2**16
d2`` (``d0, d1`` in [-128, 127], ``|d2| <= 65``). Per word and chunk the three digit sums
combine exactly in int32, the first starting from ``-(8 + zp) * sum x_int`` over the word's 8 k
(``-sum x_int`` is written with the digits): ``sum x_int (u - 8 - zp) = sum x_int (q - zp)``,
below ``2**22 * 8 * 63 < 2**31`` (the factory sends zero points outside [-56, 55] to the float
path; int32 wraps in between, so only the sum must fit). That integer, converted once, times
its group's scale (every group holds whole words: groups of 32, 64 or multiples of 128),
is added into float32 sums, reduced at the row's end and scaled by ``2**(E - 22)``. Roundings:
x's to ``2**(E - 23)`` as for int8, and float32 accumulation of one term per 8 weights (the
float path rounds one per weight). Rows whose x is not finite or is tiny take the float path.
Zero points (asymmetric weights) cost a ``vpmulld`` per word and chunk.

bf16 activations (``LowbitGemmSpec.digits`` 2) take two digits, ``x_int = rint(x * 2**(14 -
E))``: four ``vpdpbusd`` and one shift fewer per 128 weights, the kernel ~1.2x as fast with its
weights in cache (Zen 4, 2 threads, 3072 x 768: 31.1 -> 28.0 us). x is then rounded to
``2**(E - 15)``, which the output's bf16 rounding and eager bf16's own (of each dequantised
weight) outweigh where the row has no large outliers (``SPREAD``); rows that have them take
three.
"""
from __future__ import annotations

from llvmlite import ir

from . import gemm_lowbit_vnni, simd, vmath
from .bf16 import load_as
from .gemm_lowbit_vnni import HEAD, each_vector, multiplier, scan_row, store_factor
from .irutil import Fn, const, f32, i8, i16, i32, i64, ptr

CHUNK = 128                # k of a packed chunk (8 nibbles x 16 words)
VEC = 64                   # bytes of a 512-bit register
# per chunk of an x row: the low and high nibbles' digits of planes 0, 1, 2, then -sum x_int per
# word (16 int32)
CHUNK_BYTES = 7 * VEC
# a bf16 x row takes two digits where at least half its elements have |x| >= 2**(E - SPREAD):
# the digits' rounding, uniform within 2**(E - 15) on each element, is then in the mean square
# at most half of what eager bf16 puts into the products by rounding each dequantised weight to
# bf16 (uniform within 2**-9 of it) against x and w of independent signs: (K 2**(2E - 30)) /
# ((K / 2) 2**(2E - 2 SPREAD) 2**-18). A row of a few large outliers takes three digits.
SPREAD = 5
I8x64 = ir.VectorType(i8, 64)
I32x16 = ir.VectorType(i32, 16)
# vpshufb control: byte 4 g + t of each 128-bit lane <- byte 4 t + g (a 4 x 4 transpose)
_TRANSPOSE = [4 * (j % 4) + (j % 16) // 4 for j in range(64)]


def usable(spec, lanes: int) -> bool:
    """int4 on AVX-512, in groups that hold whole words of a chunk; a decode kernel
    of one x row or one generic over rows (a lone row goes by digits, several by the float
    path's tiles, which share each weight's lookup among them and are as fast there)."""
    g = spec.group
    return (spec.bits == 4 and lanes == 16 and g % 32 == 0
            and (CHUNK % g == 0 or g % CHUNK == 0) and spec.m in (0, 1))


def either_usable(spec, lanes: int) -> bool:
    """Whether ``spec`` may take a ``vpdpbusd`` path, int8's or this one (the factory also asks
    the target)."""
    return gemm_lowbit_vnni.usable(spec, lanes) or usable(spec, lanes)


def chunk_bytes(digits: int) -> int:
    """Bytes of a chunk of an x row in ``digits`` digits: two vectors a digit, then the words'
    ``-sum x_int``."""
    return (2 * digits + 1) * VEC


def row_bytes(kp: int) -> int:
    """Bytes of one x row's digits over the padded K (three digits: the most a row takes)."""
    return kp // CHUNK * CHUNK_BYTES


def x_bytes(spec, kp: int) -> int:
    """Bytes of an x row's planes (int8) or digits (int4) on the vpdpbusd path."""
    return gemm_lowbit_vnni.row_bytes(spec.k) if spec.bits == 8 else row_bytes(kp)


def emit_planes(f: Fn, k: int, kp: int, dtype: str, x, planes, heads, rows,
                digits: int = 3) -> None:
    """x rows (float32 or bf16, K a row) -> per row its head (as gemm_lowbit_vnni's) and its
    digits per chunk (zeros past K), for the rows that may take them. ``digits`` 2: a row whose
    two digits are as fine as eager bf16's rounding (``SPREAD``) takes two, its head's second
    flag set; the others three, the flag cleared."""
    b = f.b
    with f.for_range(0, rows, name="pr") as r:
        src = simd.gep(b, x, b.mul(r, const(i64, k)), i16 if dtype == "bf16" else f32)
        row = simd.gep(b, planes, b.mul(r, const(i64, row_bytes(kp))), i8)
        head = simd.gep(b, heads, b.mul(r, const(i64, HEAD)), i8)
        ok, exp = scan_row(f, k, dtype, src, head)
        with f.if_(ok):
            if digits == 3:
                _write_digits(f, k, kp, dtype, src, row, head, exp, 3)
            else:
                fine = _spread(f, k, dtype, src, multiplier(b, exp, 16))
                gemm_lowbit_vnni.set_fine(b, head, fine)
                with f.if_else(fine, likely=True) as (two, three):
                    with two:
                        _write_digits(f, k, kp, dtype, src, row, head, exp, 2)
                    with three:
                        _write_digits(f, k, kp, dtype, src, row, head, exp, 3)


def _spread(f: Fn, k: int, dtype: str, src, mult) -> ir.Value:
    """Whether at least half of the row's K elements have ``|x * mult| >= 2**(14 - SPREAD)``
    (i1): ``mult`` takes x to two digits' integers."""
    b = f.b
    vt, it = simd.vty(16), simd.vty(16, i32)
    count = f.var(it, ir.Constant(it, [0] * 16), "large")
    floor = vmath.splat(vt, float(1 << (14 - SPREAD)))

    def add(v, at, n):
        a = f.call_intrinsic("llvm.fabs.v16f32", vt, [b.fmul(v, mult)])
        count.set(b.sub(count.get(), b.sext(b.fcmp_ordered(">=", a, floor), it)))
    each_vector(f, k, dtype, src, add)
    total = f.call_intrinsic("llvm.vector.reduce.add.v16i32", i32, [count.get()])
    return b.icmp_signed(">=", b.mul(total, const(i32, 2)), const(i32, k))


def _write_digits(f: Fn, k: int, kp: int, dtype: str, src, row, head, exp, digits: int) -> None:
    """One x row's factor into its head and its ``digits`` digits per chunk into ``row``."""
    b = f.b
    vt, it = simd.vty(16), simd.vty(16, i32)
    mv = store_factor(b, head, exp, 8 * digits)
    stride = chunk_bytes(digits)

    def ints(at, active: int):
        if active <= 0:
            return ir.Constant(it, [0] * 16)
        v = b.fmul(load_as(b, dtype, src, at, 16, min(active, 16)), mv)
        return b.fptosi(f.call_intrinsic("llvm.rint.v16f32", vt, [v]), it)

    def chunk(c, left=None):
        """Chunk ``c`` (i64), ``left`` k of it real (None: all)."""
        base = b.mul(c, const(i64, CHUNK))
        per = [[[] for _ in range(digits)] for _ in range(2)]   # [half][digit] per g
        words = []
        for g in range(4):
            halves = []
            for half in range(2):
                off = 32 * g + 16 * half
                xi = ints(b.add(base, const(i64, off)), 16 if left is None else left - off)
                halves.append(xi)
                for p, d in enumerate(_digits(b, xi, digits)):
                    per[half][p].append(d)
            words.append(_word_sums(b, b.add(halves[0], halves[1])))
        out = simd.gep(b, row, b.mul(c, const(i64, stride)), i8)
        for p in range(digits):
            for half in range(2):
                b.store(_interleave(b, per[half][p]),
                        simd.gep(b, out, const(i64, (2 * p + half) * VEC), i8), align=1)
        neg = b.neg(_gather_words(b, words))
        b.store(neg, simd.gep(b, out, const(i64, 2 * digits * VEC), i8), align=1)

    if k // CHUNK:
        with f.for_range(0, k // CHUNK, name="xc") as c:
            chunk(c)
    for c in range(k // CHUNK, kp // CHUNK):
        chunk(const(i64, c), k - c * CHUNK)


def _digits(b: ir.IRBuilder, xi, count: int) -> list:
    """``xi`` (|xi| <= 2**(8 count - 2)) -> its ``count`` signed byte digits (<16 x i8> each)."""
    it = xi.type
    v8 = ir.VectorType(i8, 16)
    eight = ir.Constant(it, [8] * 16)
    out, rest = [], xi
    for p in range(count):
        d = b.trunc(rest, v8)
        out.append(d)
        if p < count - 1:
            rest = b.ashr(b.sub(rest, b.sext(d, it)), eight)
    return out


def _interleave(b: ir.IRBuilder, per_g: list) -> ir.Value:
    """Four <16 x i8> (index ``4 i + t`` within 32-k block ``g``) -> the <64 x i8> the nibbles
    meet: byte ``16 i + 4 g + t``."""
    lo = b.shuffle_vector(per_g[0], per_g[1], ir.Constant(ir.VectorType(i32, 32), list(range(32))))
    hi = b.shuffle_vector(per_g[2], per_g[3], ir.Constant(ir.VectorType(i32, 32), list(range(32))))
    mask = [16 * g + 4 * i + t for i in range(4) for g in range(4) for t in range(4)]
    return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 64), mask))


def _word_sums(b: ir.IRBuilder, s) -> ir.Value:
    """<16 x i32> indexed ``4 i + t`` -> <4 x i32> of the sums over ``t``, indexed ``i``."""
    def pick(t):
        return b.shuffle_vector(s, s, ir.Constant(ir.VectorType(i32, 4),
                                                  [4 * i + t for i in range(4)]))
    return b.add(b.add(pick(0), pick(1)), b.add(pick(2), pick(3)))


def _gather_words(b: ir.IRBuilder, per_g: list) -> ir.Value:
    """Four <4 x i32> (block ``g``, index ``i``) -> <16 x i32>, word ``4 i + g``."""
    v8 = ir.VectorType(i32, 8)
    lo = b.shuffle_vector(per_g[0], per_g[1], ir.Constant(v8, list(range(8))))
    hi = b.shuffle_vector(per_g[2], per_g[3], ir.Constant(v8, list(range(8))))
    mask = [4 * g + i for i in range(4) for g in range(4)]
    return b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 16), mask))


def emit_tile(tiles, rr: int, digits: int = 3) -> ir.Function:
    """``tile(row, head, w, scale, zp, sums)``: ``sums[r]`` = x row . dequantised W row ``r``
    for the block's first ``rr`` W rows, from the x row's ``digits`` digits and head (``zp``:
    the block's zero points, int8 per group, read with ``spec.zero_point``).
    The block's chunks are read in their packed order, one stream, prefetched as the float
    path's are."""
    spec, module = tiles.s, tiles.module
    f = Fn(module, f"{spec.symbol}.vnni4d{digits}x{rr}", ir.VoidType(), [ptr] * 6,
           ["row", "head", "w", "scale", "zp", "sums"])
    b = f.b
    row, head, w, scale, zp, sums = f.args
    vt = simd.vty(16)
    zero = ir.Constant(I32x16, [0] * 16)
    factor = b.fptrunc(b.load(head, typ=ir.DoubleType()), f32)   # 2**(E - 8 digits + 2), exact
    transpose = ir.Constant(I8x64, _TRANSPOSE)
    low4 = ir.Constant(I8x64, [15] * 64)
    acc = [f.var(vt, vmath.splat(vt, 0.0), f"a{r}") for r in range(rr)]

    def dot(s, a, x):
        return f.call_intrinsic("llvm.x86.avx512.vpdpbusd.512", I32x16, [s, a, x])

    with f.for_range(0, tiles.kp // CHUNK, name="c") as c:
        at = b.mul(c, const(i64, chunk_bytes(digits)))
        xs = [b.load(simd.gep(b, row, b.add(at, const(i64, j * VEC)), i8), typ=I32x16,
                     align=1) for j in range(2 * digits)]
        neg = b.load(simd.gep(b, row, b.add(at, const(i64, 2 * digits * VEC)), i8),
                     typ=I32x16, align=1)
        x8 = b.shl(neg, ir.Constant(I32x16, [3] * 16))      # -8 sum x_int
        tiles.prefetch_int4(f, w, scale, c, spec.rr * VEC)
        for r in range(rr):
            word = b.load(simd.gep(b, w, b.mul(b.add(b.mul(c, const(i64, spec.rr)),
                                                     const(i64, r)), const(i64, VEC)), i8),
                          typ=I8x64, align=4)
            t = f.call_intrinsic("llvm.x86.avx512.pshuf.b.512", I8x64, [word, transpose])
            lo = b.bitcast(b.and_(t, low4), I32x16)
            hi16 = b.lshr(b.bitcast(t, ir.VectorType(i16, 32)), ir.Constant(
                ir.VectorType(i16, 32), [4] * 32))
            hi = b.bitcast(b.and_(b.bitcast(hi16, I8x64), low4), I32x16)
            # plane 0's sums start from -(8 + zp) sum x_int: the u - 8 - zp of every nibble
            start = b.add(x8, b.mul(_zero_points(f, tiles, zp, c, r), neg)) \
                if spec.zero_point else x8
            s = [dot(dot(start if p == 0 else zero, lo, xs[2 * p]), hi, xs[2 * p + 1])
                 for p in range(digits)]
            total = s[0]
            for p in range(1, digits):
                total = b.add(total, b.shl(s[p], ir.Constant(I32x16, [8 * p] * 16)))
            acc[r].set(vmath.fma(b, b.sitofp(total, vt), _scales(f, tiles, scale, c, r),
                                 acc[r].get()))
    for r in range(rr):
        simd.store_scalar(b, b.fmul(simd.hsum(b, acc[r].get()), factor), sums, const(i64, r))
    f.finish()
    return f.fn


def _per_word(f: Fn, tiles, values, c, r: int, elem: ir.Type) -> ir.Value:
    """W row ``r``'s per-group ``values`` (``elem``) of chunk ``c``, one per word (word ``4 i +
    g`` in 32-k block g), as 16 lanes of ``elem``."""
    b, g = f.b, tiles.s.group
    base = b.add(const(i64, r * tiles.ng), b.mul(c, const(i64, CHUNK // g)) if g <= CHUNK
                 else b.udiv(b.mul(c, const(i64, CHUNK)), const(i64, g)))
    if g >= CHUNK:
        return simd.broadcast(b, simd.load_scalar(b, values, base, elem), 16)
    per = CHUNK // g            # groups a chunk: 4 (32 k) or 2 (64 k)
    v = b.load(simd.gep(b, values, base, elem), typ=ir.VectorType(elem, per), align=1)
    mask = [(j % 4) * per // 4 for j in range(16)]
    return b.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 16), mask))


def _scales(f: Fn, tiles, scale, c, r: int) -> ir.Value:
    return _per_word(f, tiles, scale, c, r, f32)


def _zero_points(f: Fn, tiles, zp, c, r: int) -> ir.Value:
    """W row ``r``'s zero points per word of chunk ``c``, as int32."""
    return f.b.sext(_per_word(f, tiles, zp, c, r, i8), I32x16)
