"""int8 weights times float activations on ``vpdpbusd`` (AVX512_VNNI), exact to float32.

The float schedule of gemm_lowbit.py spends three instructions on every 16 weights (widen,
convert, FMA) and was bound by them, not by memory. Here an x row is instead written once per
call as integers: ``x_int = rint(x * 2**(22 - E))`` with ``max|x| < 2**E``, so
``|x_int| <= 2**22``, offset to ``u = x_int + 2**23`` in [0, 2**24) and split into three
unsigned byte planes ``u = u0 + 2**8 u1 + 2**16 u2``. One ``vpdpbusd`` multiplies 64 bytes of
a plane by 64 int8 weights (the weights as torchao holds them, signed), accumulating int32, so
a weight costs 3/64 of an instruction. At the end of a W row the plane sums are combined in
float64, exactly (|sum| < 2**49):

    sum_k x_int[k] q[k] = S0 + 2**8 S1 + 2**16 S2 - 2**23 * sum_k q[k]

(``sum_k q[k]``, the row sums, are computed once by the factory), then scaled by
``2**(E - 22) * scale[n]`` and rounded once to float32. The only other rounding is x's to
``2**(E - 23)``, 2**-23 of the row's largest |x|: below float32 accumulation error (the float
path's). Rows whose x is not finite or is below ``2**-100`` (where the scale
would leave float range) go through the float path, which gives ATen's inf and NaN.

int32 lanes hold at most K * 255 * 128 summed over a plane, so K <= 2**16.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, simd, vmath
from .irutil import Fn, const, f32, i8, i16, i32, i64, ptr

MAX_K = 1 << 16
# int4 weights on the planes (the prefill's grouped panels, gemm_lowbit_planes.py): int32 sums
# are taken per GROUP_QUADS k quads (32 k: |sum x_int (q - zp)| <= 2**22 * 15 * 32 < 2**31, so
# the planes' sums combine exactly in int32), each group of panel rows followed by two more: the
# columns' sums of ``q - zp`` and their scales
GROUP_QUADS = 8
GROUP_ROWS = GROUP_QUADS + 2
PLANES = 3               # planes per x row: exact to float32
HEAD = 16                # bytes a row's head: the float64 factor, then two i32 flags
READY_AT = 8             # byte of the head's first flag (is_ready)
FINE_AT = 12             # byte of the head's second flag (is_fine)
STEP = 64                # k per vpdpbusd (bytes of a 512-bit register)
TINY = -100              # rows with max|x| below 2**TINY take the float path
F64 = ir.DoubleType()
I32x16 = ir.VectorType(i32, 16)


def usable(spec, lanes: int) -> bool:
    """Whether the spec is in this path's reach (the factory also asks the target for VNNI)."""
    return (spec.bits == 8 and lanes == 16 and spec.group >= spec.k and not spec.zero_point
            and spec.k <= MAX_K)


def plane_stride(k: int, plane_bits: int = 8) -> int:
    """Bytes of one plane: K rounded up to whole steps (12-bit planes: two bytes a k, as many
    groups of 32 k as the weights' panels hold)."""
    return -(-k // STEP) * STEP * (2 if plane_bits == 12 else 1)


def row_bytes(k: int, count: int = PLANES, plane_bits: int = 8) -> int:
    """Bytes of one x row's planes (a (``count`` rows, ``plane_stride``) uint8 matrix)."""
    return count * plane_stride(k, plane_bits)


def emit_planes(f: Fn, k: int, dtype: str, x, planes, heads, rows, count: int = PLANES,
                plane_bits: int = 8) -> None:
    """x rows (float32 or bf16, K a row) -> per row its head (the factor ``2**(E - bits + 2)``
    as float64, then two i32 flags: 1 planes valid, 0 take the float path; and 1 the planes are
    as fine as TF32's rounding of x, 0 not: a row whose largest |x| is over ~8x its rms) and
    its ``count`` planes ``u0, u1, ...`` (``row_bytes`` apart; bytes, zero past K). ``bits = 8 *
    count``: three planes carry x to 2**-23 of the row's largest |x| (the module doc), two to
    2**-15 (the prefill under ``torch.set_float32_matmul_precision("high")``). ``plane_bits``
    12 (two planes, exact as three of 8): a plane's 12-bit digit ``d`` of each k as two bytes,
    ``d & 15`` then ``d >> 4``, which times ``(q, 16 q)`` give ``d q`` (gemm_tile_grouped.py);
    the digits of x itself, not offset: the low one unsigned, the high one signed (its ``d >>
    4`` an s8 byte, for ``tdpbssd``)."""
    bits = plane_bits * count
    per_k = 2 if plane_bits == 12 else 1   # bytes a k of a plane
    b = f.b
    vt, it = simd.vty(16), simd.vty(16, i32)
    stride = plane_stride(k, plane_bits)
    with f.for_range(0, rows, name="pr") as r:
        src = simd.gep(b, x, b.mul(r, const(i64, k)), i16 if dtype == "bf16" else f32)
        row = simd.gep(b, planes, b.mul(r, const(i64, row_bytes(k, count, plane_bits))), i8)
        head = simd.gep(b, heads, b.mul(r, const(i64, HEAD)), i8)
        ok, exp = scan_row(f, k, dtype, src, head)
        with f.if_(ok):
            mv = store_factor(b, head, exp, bits)
            for p in range(count):   # zeros past K (the weights there are masked to 0 anyway)
                with f.for_range(k // 16 * 16 * per_k, stride, step=16, name="pz") as z:
                    b.store(ir.Constant(ir.VectorType(i8, 16), [0] * 16),
                            simd.gep(b, row, b.add(z, const(i64, p * stride)), i8),
                            align=1)

            squares = f.var(vt, ir.Constant(vt, [0.0] * 16), "squares")

            def split(v, at, n):
                scaled = b.fmul(v, mv)
                if bits < 24:
                    squares.set(vmath.fma(b, scaled, scaled, squares.get()))
                xi = b.fptosi(f.call_intrinsic("llvm.rint.v16f32", vt, [scaled]), it)
                if plane_bits == 12:   # x itself: digit 0 unsigned, digit 1 signed
                    for p in range(count):
                        d = b.lshr(xi, ir.Constant(it, [12 * p] * 16)) if p else xi
                        lo, hi = (b.trunc(x, ir.VectorType(i8, 16)) for x in (
                            b.and_(d, ir.Constant(it, [15] * 16)),
                            b.and_(b.lshr(d, ir.Constant(it, [4] * 16)),
                                   ir.Constant(it, [255] * 16))))
                        pair = b.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), [
                            (j // 2) + 16 * (j % 2) for j in range(32)]))
                        simd.store_any(b, pair, row, b.add(b.mul(at, const(i64, 2)),
                                                           const(i64, p * stride)), 2 * n,
                                       elem=i8)
                    return
                u = b.add(xi, ir.Constant(it, [1 << (bits - 1)] * 16))
                for p in range(count):
                    byte = b.trunc(b.lshr(u, ir.Constant(it, [8 * p] * 16)) if p else u,
                                   ir.VectorType(i8, 16))
                    simd.store_any(b, byte, row, b.add(at, const(i64, p * stride)), n, elem=i8)
            each_vector(f, k, dtype, src, split)
            if bits < 24:
                # x's rounding (a step of 2**(E - bits + 2)) no coarser than TF32's, in the mean
                # square: 2**E <= 16 rms(x), i.e. sum (x * mult)**2 >= K * 2**(2 bits - 12)
                floor = ir.Constant(f32, k * 2.0 ** (2 * bits - 12))
                set_fine(b, head, b.fcmp_ordered(">=", simd.hsum(b, squares.get()), floor))


def each_vector(f: Fn, k: int, dtype: str, src, body) -> None:
    """``body(v, at, n)`` on each 16 floats of an x row (``n`` of them real, zeros past K)."""
    b = f.b
    if k // 16:
        with f.for_range(0, k // 16, name="pv") as v:
            at = b.mul(v, const(i64, 16))
            body(bf16.load_as(b, dtype, src, at, 16), at, 16)
    if k % 16:
        at = const(i64, k // 16 * 16)
        body(bf16.load_as(b, dtype, src, at, 16, k % 16), at, k % 16)


def scan_row(f: Fn, k: int, dtype: str, src, head) -> tuple:
    """An x row's (i1 it may go by planes: finite and max|x| >= 2**TINY, ``exp``: max|x| <
    2**exp), the first flag stored in its head and the second (fine) set to 1."""
    b = f.b
    vt = simd.vty(16)
    b1 = ir.VectorType(ir.IntType(1), 16)
    amax = f.var(vt, ir.Constant(vt, [0.0] * 16), "amax")
    bad = f.var(b1, ir.Constant(b1, [0] * 16), "bad")

    def scan(v, at, n):
        a = f.call_intrinsic("llvm.fabs.v16f32", vt, [v])
        amax.set(f.call_intrinsic("llvm.maxnum.v16f32", vt, [amax.get(), a]))
        # NaN and inf fail this ordered compare
        bad.set(b.or_(bad.get(), b.fcmp_unordered(">=", a, simd.broadcast(
            b, ir.Constant(f32, float("inf")), 16))))

    each_vector(f, k, dtype, src, scan)
    top = simd.hmax(b, amax.get())
    any_bad = f.call_intrinsic("llvm.vector.reduce.or.v16i1", ir.IntType(1), [bad.get()])
    exp = b.sub(b.and_(b.lshr(b.bitcast(top, i32), const(i32, 23)), const(i32, 255)),
                const(i32, 126))                       # max|x| < 2**exp
    ok = b.and_(b.not_(any_bad), b.icmp_signed(">=", exp, const(i32, TINY)))
    b.store(b.zext(ok, i32), simd.gep(b, head, const(i64, READY_AT), i8))
    set_fine(b, head, ir.Constant(ir.IntType(1), 1))
    return ok, exp


def multiplier(b: ir.IRBuilder, exp, bits: int) -> ir.Value:
    """``2**(bits - 2 - exp)``, which takes x (``max|x| < 2**exp``) to integers of ``bits - 1``
    bits and a sign, broadcast to 16 lanes."""
    mult = b.bitcast(b.shl(b.sub(const(i32, bits - 2 + 127), exp), const(i32, 23)), f32)
    return simd.broadcast(b, mult, 16)


def store_factor(b: ir.IRBuilder, head, exp, bits: int) -> ir.Value:
    """Store the row's factor ``2**(exp - bits + 2)`` (float64) in its head; return the
    ``multiplier`` that takes x to integers."""
    factor = b.bitcast(b.shl(b.zext(b.add(exp, const(i32, 1023 - bits + 2)), i64),
                             const(i64, 52)), F64)
    b.store(factor, head)
    return multiplier(b, exp, bits)


def is_ready(b, head) -> ir.Value:
    """The flag ``emit_planes`` left in an x row's head (i1)."""
    return b.icmp_signed("!=", simd.load_scalar(b, head, const(i64, READY_AT // 4), i32),
                         const(i32, 0))


def is_fine(b, head) -> ir.Value:
    """The second flag of an x row's head (i1): its two planes round x no more coarsely than
    TF32 (``emit_planes``), or it takes two digits (int4's decode, gemm_lowbit_vnni4.py)."""
    return b.icmp_signed("!=", simd.load_scalar(b, head, const(i64, FINE_AT // 4), i32),
                         const(i32, 0))


def set_fine(b, head, fine) -> None:
    """Store ``is_fine``'s flag (i1) in an x row's head."""
    b.store(b.zext(fine, i32), simd.gep(b, head, const(i64, FINE_AT), i8))


def combine_planes(b: ir.IRBuilder, sums: list, qsum, factor, scale, count: int) -> ir.Value:
    """One output vector of the prefill from the float32 sums of an x row's ``count`` planes
    (each exact below 2**24, else rounded once), the columns' ``sum_k q`` (float32, exact) and
    scales, and the row's factor (float32 broadcast):
    ``(S0 + 2**8 S1 (+ 2**16 S2) - 2**(8 count - 1) sum q) * factor * scale``. The two large
    terms first, each product exact: one rounding, then the rest. The combine kernel and the
    fused epilogue of the u8s8 micro-kernel share it, so both give the same bits."""
    vt = sums[0].type
    t = vmath.fma(b, sums[-1], vmath.splat(vt, float(1 << 8 * (count - 1))),
                  b.fmul(qsum, vmath.splat(vt, -float(1 << 8 * count - 1))))
    low = sums[0] if count == 2 else vmath.fma(b, sums[1], vmath.splat(vt, 256.0), sums[0])
    return b.fmul(b.fmul(b.fadd(low, t), factor), scale)


def load_factor(b: ir.IRBuilder, head, lanes: int) -> ir.Value:
    """An x row's factor from its head, as float32 in ``lanes`` lanes."""
    return simd.broadcast(b, b.fptrunc(b.load(head, typ=F64), f32), lanes)


def emit_tile(module, spec, rr: int, streamed: bool = False) -> ir.Function:
    """``tile(row, head, w, scale, wsum, sums)``: ``sums[r]`` = x row . dequantised W row
    ``r`` for ``r < rr``, from the x row's planes and head and the W rows' sums of q.

    The block's W rows are read a 64-byte step of each in turn, so each plane load serves ``rr``
    rows (fastest where the weights come from cache), or with ``streamed`` one row after another,
    prefetched ``spec.ahead`` bytes on (0: not at all): the thread's rows are contiguous, so
    its reads are one stream.
    A lone x row (decode) reads its weights from memory, where ``rr`` streams a thread left them
    waiting: GPT-2's 49 int8 linears in a token's order, Zen 5, 2 threads, in one process,
    28.7-30.6 -> 35.1-37.7 GB/s against a plain read of the same buffers' 40-45. The stream is
    prefetched into every cache level, as int4's is: a non-temporal prefetch fills L1 alone on
    Intel cores, whose 16 fill buffers then bound a thread's stream (Emerald Rapids-class Xeon, 2
    threads: 2304 x 768 13.5 -> 88 GB/s with the weights in L3; GPT-2 int8 decode 69-71 -> 136-145
    tokens/s)."""
    kind = "vnnis" if streamed else "vnni"
    f = Fn(module, f"{spec.symbol}.{kind}{rr}", ir.VoidType(), [ptr] * 6,
           ["row", "head", "w", "scale", "wsum", "sums"])
    b, k = f.b, spec.k
    row, head, w, scale, wsum, sums = f.args
    stride = plane_stride(k)
    zero = ir.Constant(I32x16, [0] * 16)
    factor = b.load(head, typ=F64)

    def plane(at, p):
        return b.load(simd.gep(b, row, b.add(at, const(i64, p * stride)), i8), typ=I32x16,
                      align=1)

    def dot(acc, xs, q):
        return f.call_intrinsic("llvm.x86.avx512.vpdpbusd.512", I32x16, [acc, xs, q])

    def weights(base, at, active: int):
        return b.bitcast(simd.load_any(b, base, at, STEP, active, elem=i8), I32x16)

    def k_loop(step, fetch):
        """``step(at, active)`` over K in 64-byte steps, ``fetch(at)`` before each whole one."""
        if k // STEP:
            with f.for_range(0, k // STEP, name="kv") as c:
                at = b.mul(c, const(i64, STEP))
                fetch(at)
                step(at, STEP)
        if k % STEP:
            step(const(i64, k // STEP * STEP), k % STEP)

    if streamed:
        acc = [f.var(I32x16, zero, f"s{p}") for p in range(3)]
        with f.for_range(0, rr, name="wr") as r:
            wrow = simd.gep(b, w, b.mul(r, const(i64, k)), i8)
            for a in acc:
                a.set(zero)

            def step(at, active):
                q = weights(wrow, at, active)
                for p in range(3):
                    acc[p].set(dot(acc[p].get(), plane(at, p), q))
            k_loop(step, lambda at: simd.prefetch(
                b, simd.gep(b, wrow, b.add(at, const(i64, spec.ahead)), i8))
                if spec.ahead else None)
            _finish_row(f, [a.get() for a in acc], factor, wsum, scale, sums, r)
    else:
        acc = [[f.var(I32x16, zero, f"s{r}_{p}") for p in range(3)] for r in range(rr)]

        def step(at, active):
            xs = [plane(at, p) for p in range(3)]
            for r in range(rr):
                q = weights(w, b.add(at, const(i64, r * k)), active)
                for p in range(3):
                    acc[r][p].set(dot(acc[r][p].get(), xs[p], q))

        def fetch(at):  # the same step of the next block's rows
            for r in range(rr):
                simd.prefetch(b, simd.gep(b, w, b.add(at, const(i64, r * k + rr * k)), i8))
        k_loop(step, fetch)
        for r in range(rr):
            _finish_row(f, [a.get() for a in acc[r]], factor, wsum, scale, sums,
                        const(i64, r))
    f.finish()
    return f.fn


def _finish_row(f: Fn, planes: list, factor, wsum, scale, sums, r) -> None:
    """``sums[r]``: W row ``r``'s three plane sums combined exactly in float64, less the
    offset's ``2**23 * sum q``, scaled by the x row's factor and the row's scale, rounded once."""
    b = f.b
    s = [b.sitofp(f.call_intrinsic("llvm.vector.reduce.add.v16i32", i32, [v]), F64)
         for v in planes]
    total = b.fadd(b.fadd(s[0], b.fmul(s[1], ir.Constant(F64, 256.0))),
                   b.fmul(s[2], ir.Constant(F64, 65536.0)))
    qsum = b.sitofp(simd.load_scalar(b, wsum, r, i32), F64)
    total = b.fsub(total, b.fmul(qsum, ir.Constant(F64, float(1 << 23))))
    sc = b.fpext(simd.load_scalar(b, scale, r), F64)
    simd.store_scalar(b, b.fptrunc(b.fmul(b.fmul(total, factor), sc), f32), sums, r)
