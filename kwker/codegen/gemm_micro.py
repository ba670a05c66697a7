"""The GEMM micro-kernel: an MR x NR block of C held in vector registers, updated with FMAs.

Contract (BLIS's, with the vector dimension along N because C and the weights are row-major):

    C[0:mr, 0:nr] (+)= A[0:mr, 0:kc] @ B[0:kc, 0:nr]      then, on the last K block,
    C = act(C + bias) + residual                          (the fused epilogue)

- B is read as ``nv`` vectors per k step from ``b + k*ldb`` (a packed panel: ldb = NR, zero-padded
  so every load is a full vector; or a row-major matrix: ldb = n, the last vector masked).
- A is broadcast one element per row per k step from ``a + r*a_rs + k*a_ks`` (packed micro-panel:
  a_rs = 1, a_ks = MR; or the activation matrix itself: a_rs = lda, a_ks = 1).
- ``first`` starts from zero (``beta = 0``: C is never read), otherwise C holds the partial sum of
  earlier K blocks. float32 accumulators sum ``SEGMENT_PRODUCTS`` products per lane, then add
  their sum to C's partial sum and restart from zero (BLIS's ``C += A B`` per K block, at a
  finer grain): the error of a long K is that of MKL's blocked sums, not of one serial chain.
- Only the first ``cols`` columns (a compile-time count, < nr only at the N edge) are stored,
  with masked stores: edge tiles are the same code, not a scalar loop.
- ``ksplit`` > 1 keeps that many independent accumulator sets over interleaved k (summed at the
  end of each segment), so tiles with few rows (decode-sized M) still have enough FMA chains
  in flight.

bfloat16 (``dtype="bf16"``): A and B hold k *pairs*, one 32-bit word of two bf16 per element
(k even in the low half), so every stride above counts words and the loop runs over pairs. A
step is one ``vdpbf16ps`` per accumulator (``dot="dpbf16"``, CPUs with AVX512_BF16: 2 multiply-
adds per lane, float32 accumulation), or, elsewhere, the two halves widened to float32 (a shift
and a mask) and two FMAs (``dot="widen"``). ``c`` then holds float32 partial sums (a scratch tile
or chunk of the driver's, row stride ``ldc``); the last K block adds the bias in float32, runs the
epilogue in float32 and rounds once to bf16 into ``out`` (row stride ``ldo``), reading a bf16
residual from there; with ``vdpbf16ps`` the rounding is ``vcvtneps2bf16`` (bf16.narrow). For
float32, ``out`` is ``c``.

int8 (``dot="vnni"``, CPUs with AVX512_VNNI): A and B hold k *quads*, a 32-bit word of four
u8 (A) or s8 (B) per element, and a step is one ``vpdpbusd`` per accumulator into int32 sums
(exact). The last K block converts them to float32 times their column's scale, read where the
bias would be, and adds the bias ``bias_at`` floats further (the u8s8 contract of the tile path,
gemm_tile.py); partial sums cross K blocks as their bits in ``c``. With ``planes`` (the int8
prefill's byte planes, gemm_lowbit_vnni.py) every ``planes`` rows of the tile are one x row's
planes: the last K block combines them in the registers into that row of ``out`` (row stride
``ldo``), from the row's factor in its head and the columns' scales and sums of q, and runs the
epilogue on the ``mr / planes`` rows; ``c`` is then a scratch for partial sums, as in bf16.
``grouped`` (int4 weights, scales per group along K): B is the grouped panels of
gemm_lowbit_planes.py, and the int32 sums restart every ``GROUP_QUADS`` k quads, each group's
combined exactly in int32 and added, times the group's column scales, into float32 sums per x
row (those are the partial sums in ``c``).

Screened tiles (``screen`` = 1 largest, -1 smallest; the fused top-k): the last K block stores
no epilogue. It compares the float32 tile in the registers against ``thr[r]``, a stale heap root
per row (NaN: every lane passes), stores the tile to ``c`` only if some valid lane may be
better, and returns the rows that may (bit r: row r; 0: nothing stored). The test is a superset
of ATen's (unordered: NaN passes either way), and of the test on the bf16-rounded scores too,
since rounding is monotone and leaves the bf16 root as it is.

Streamed weights (``prefetch``, pre-packed panels read once from memory: the decode rows' GEMV,
and the first row tile of each block of panels): every line of B is prefetched ``prefetch``
bytes ahead of the k step that reads it, into every cache level. The hardware prefetchers alone
left the first pass over each block of panels waiting on memory, with no product to hide it
behind. Intel Xeon with AMX (KVM model 167), float32, 2 threads, best of 4 x 15: weights
evicted between calls, 64 x 4096 x 1024 2.43 -> 1.91 ms and 64 x 1024 x 4096 2.60 -> 2.16
(eager: 2.7); weights in the caches, 1.74 -> 1.65 and 2.10 -> 1.79, 1024^3 6.27 -> 6.11; a
decode row's GEMV, already at the memory's speed, unchanged. Zen 4/5 not measured.

Fast-math: none; the products are explicit ``llvm.fma`` (one rounding per step, like MKL).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from llvmlite import ir

from . import bf16, simd, vmath
from .gemm_lowbit_vnni import GROUP_QUADS, GROUP_ROWS, HEAD, combine_planes, load_factor
from .irutil import Fn, const, defined, f32, i8, i16, i32, i64, intrinsic, ptr, smin, void

FIRST, LAST = 1, 2  # bits of the ``mode`` argument
# products a float32 accumulator sums before its sum is added to the partial sum in ``c`` and it
# restarts from zero: one serial chain over all of K lost ~10x the accuracy of MKL's blocked sums
# (K = 4096-16384: max error 1.5e-5 against 1.5e-6); 128-256 products match MKL's. bf16 products
# (2**-9 each) are not segmented: 1024^3 bf16 ran ~8% slower with them (Zen 4)
SEGMENT_PRODUCTS = 256


@dataclass(frozen=True)
class Micro:
    """Compile-time shape of one micro-kernel variant."""
    mr: int            # rows of the tile
    nv: int            # vectors per row
    lanes: int         # floats per vector
    cols: int          # valid columns (<= nv * lanes); fewer only on the N-edge tile
    a_rs: int          # A element stride between rows
    a_ks: int          # A element stride between k steps
    ldb: int           # B element stride between k steps
    b_masked: bool     # B is not padded: mask the loads of the last vector
    ldc: int           # C (and residual) row stride
    epilogue: str = "none"
    bias: bool = False
    residual: bool = False
    ksplit: int = 1
    unroll: int = 1
    dot: str = "fma"   # fma (float32) | dpbf16 | widen (bf16 pairs) | vnni (u8s8 quads)
    ldo: int = 0       # bf16: row stride of ``out`` and the residual
    screen: int = 0    # 1 / -1: screened tile against per-row roots (see module doc)
    out: str = ""      # type of out and the residual when not the inputs' ("f32" with bf16)
    bias_at: int = 0   # int8: elements from the column scales to the bias (both at ``bias``)
    planes: int = 0    # int8: rows of the tile per x row, combined by the epilogue (module doc)
    grouped: bool = False  # planes against grouped panels (int4; module doc)
    prefetch: int = 0  # bytes ahead of its reads a packed B is prefetched (module doc); 0: none

    @property
    def bf16(self) -> bool:
        return self.dot in ("dpbf16", "widen")

    @property
    def int8(self) -> bool:
        return self.dot == "vnni"

    @property
    def has_out(self) -> bool:
        """Whether ``out`` is an argument of its own (``c`` then holds partial sums only)."""
        return self.bf16 or bool(self.planes)

    @property
    def ld_out(self) -> int:
        return self.ldo if self.has_out else self.ldc

    @property
    def out_dtype(self) -> str:
        return self.out or ("bf16" if self.bf16 else "f32")

    @property
    def name(self) -> str:
        return (f"uk.{self.mr}x{self.nv}x{self.lanes}.c{self.cols}.a{self.a_rs}_{self.a_ks}"
                f".b{self.ldb}{'m' if self.b_masked else ''}.s{self.ksplit}.u{self.unroll}"
                + ("" if self.dot == "fma" else f".{self.dot}.o{self.ldo}")
                + (f".screen{self.screen}" if self.screen else "")
                + (f".o{self.out}" if self.out else "")
                + (f".ba{self.bias_at}" if self.bias_at else "")
                + (f".pl{self.planes}o{self.ldo}" if self.planes else "")
                + (".grp" if self.grouped else "")
                + (f".pf{self.prefetch}" if self.prefetch else ""))


def emit_micro(module: ir.Module, mk: Micro) -> ir.Function:
    """``void uk(ptr a, ptr b, ptr c, i64 kc, i64 mode, ptr bias, ptr residual)``, and for bf16
    an eighth argument ``ptr out``; with ``planes`` ``out`` and then ``ptr heads, ptr scale, ptr
    qsum``; screened: ``i64 uk(..., ptr thr)``, the rows that may enter (``c`` stored if any).
    Emitted once per variant."""
    existing = defined(module, mk.name)
    if existing is not None:
        return existing
    names = ["a", "b", "c", "kc", "mode", "bias", "res"] + (["out"] if mk.has_out else []) \
        + (["heads", "scale", "qsum"] if mk.planes else []) + (["thr"] if mk.screen else [])
    f = Fn(module, mk.name, i64 if mk.screen else void,
           [ptr, ptr, ptr, i64, i64, ptr, ptr] + [ptr] * (len(names) - 7), names)
    # noinline: a constant kc must not let LLVM unroll the k loop completely (compile time)
    f.fn.attributes.add("noinline")
    a, bp, c, kc, mode, bias, res = f.args[:7]
    out = f.args[7] if mk.has_out else c
    for arg in f.args:
        if arg.type == ptr:
            arg.add_attribute("noalias")
    if mk.grouped:
        _grouped(f, mk, a, bp, c, kc, mode, bias, res, out)
        return f.finish()
    b = f.b
    L, nv, mr = mk.lanes, mk.nv, mk.mr
    vt = simd.vty(L)
    it = simd.vty(L, i32)
    zero = ir.Constant(it, [0] * L) if mk.int8 else vmath.splat(vt, 0.0)
    last_active = mk.cols - (nv - 1) * L  # lanes of the last vector that hold real columns
    acc = [[[f.var(zero.type, zero, f"acc{s}_{r}_{v}") for v in range(nv)] for r in range(mr)]
           for s in range(mk.ksplit)]

    first = b.icmp_unsigned("!=", b.and_(mode, const(i64, FIRST)), const(i64, 0))
    # whether ``c`` holds a partial sum to add (an earlier K block's, or an earlier segment's)
    partial = f.var(ir.IntType(1), b.not_(first), "partial")
    add = b.add if mk.int8 else b.fadd

    def summed():
        """The accumulator sets' sum plus ``c``'s partial sum, if it holds one."""
        total = [[acc[0][r][v].get() for v in range(nv)] for r in range(mr)]
        for s in range(1, mk.ksplit):
            total = [[add(total[r][v], acc[s][r][v].get()) for v in range(nv)]
                     for r in range(mr)]
        out = [[f.var(zero.type, total[r][v], f"sum{r}_{v}") for v in range(nv)]
               for r in range(mr)]
        with f.if_(partial.get()):
            for r in range(mr):
                for v in range(nv):
                    x = _load_c(b, c, r * mk.ldc + v * L, L, last_active, v == nv - 1)
                    out[r][v].set(add(out[r][v].get(), b.bitcast(x, it) if mk.int8 else x))
        return [[out[r][v].get() for v in range(nv)] for r in range(mr)]

    def fstep(k, s):
        """One k step into accumulator set ``s``."""
        brow = b.mul(k, const(i64, mk.ldb))
        bv = []
        for v in range(nv):
            idx = b.add(brow, const(i64, v * L))
            if mk.b_masked and v == nv - 1 and last_active < L:
                bv.append(simd.masked_load(b, bp, idx, simd.const_mask(L, last_active), L))
            else:
                bv.append(simd.load_vec(b, bp, idx, L))
        abase = b.mul(k, const(i64, mk.a_ks))
        for r in range(mr):
            av = simd.broadcast(b, simd.load_scalar(b, a, b.add(abase, const(i64, r * mk.a_rs))), L)
            for v in range(nv):
                acc[s][r][v].set(vmath.fma(b, av, bv[v], acc[s][r][v].get()))

    step = fstep if mk.dot == "fma" else _word_step(f, mk, a, bp, acc)
    group = mk.ksplit * mk.unroll
    main_end = b.mul(b.sdiv(kc, const(i64, group)), const(i64, group))
    def k_steps(lo, hi):
        with f.for_range(lo, hi, step=group, name="k") as k:
            for u in range(group):
                step(b.add(k, const(i64, u)), u % mk.ksplit)
            if mk.prefetch:  # the lines of B that many k steps on read, ``prefetch`` bytes on
                at = b.add(b.mul(k, const(i64, mk.ldb)), const(i64, mk.prefetch // 4))
                for line in range(0, group * mk.ldb, 16):
                    simd.prefetch(b, simd.gep(b, bp, b.add(at, const(i64, line))))

    if mk.dot != "fma":   # int32 sums are exact; bf16 (8-bit operands) ran slower segmented
        k_steps(const(i64, 0), main_end)
    else:   # float32 sums restart every ``segment`` k steps, added to ``c``'s partial sum
        segment = -(-SEGMENT_PRODUCTS // group) * group
        with f.for_range(0, main_end, step=segment, name="seg") as s0:
            s1 = smin(b, b.add(s0, const(i64, segment)), main_end)
            k_steps(s0, s1)
            with f.if_(b.icmp_signed("<", s1, kc)):    # more k steps follow this segment
                sums = summed()
                for r in range(mr):
                    for v in range(nv):
                        _store_c(b, sums[r][v], c, r * mk.ldc + v * L, last_active,
                                 v == nv - 1)
                        for s in range(mk.ksplit):
                            acc[s][r][v].set(zero)
                partial.set(ir.Constant(ir.IntType(1), 1))
    if group > 1:
        with f.for_range(main_end, kc, name="kt") as k:
            step(k, 0)

    total = summed()

    is_last = b.icmp_unsigned("!=", b.and_(mode, const(i64, LAST)), const(i64, 0))
    stored = f.var(i64, const(i64, -1), "stored")
    with f.if_else(is_last) as (then, otherwise):
        with then:
            if mk.screen:
                stored.set(_screen(f, mk, total, c, f.args[-1], last_active))
            elif mk.planes:
                _epilogue_planes(f, mk, total, bias, res, out, last_active)
            else:
                if mk.int8:  # the int32 sums as float32 times their column's scale (``bias``)
                    scales = [simd.load_any(b, bias, const(i64, v * L), L,
                                            last_active if v == nv - 1 else L) for v in range(nv)]
                    sums = [[b.fmul(b.sitofp(total[r][v], vt), scales[v]) for v in range(nv)]
                            for r in range(mr)]
                    _epilogue(f, mk, sums, simd.gep(b, bias, const(i64, mk.bias_at)), res, out,
                              last_active)
                else:
                    _epilogue(f, mk, total, bias, res, out, last_active)
        with otherwise:  # partial sums (int8: their bits) for the next K block
            for r in range(mr):
                for v in range(nv):
                    x = b.bitcast(total[r][v], vt) if mk.int8 else total[r][v]
                    _store_c(b, x, c, r * mk.ldc + v * L, last_active, v == nv - 1)
    if mk.screen:
        f.ret(stored.get())
    return f.finish()


def _epilogue(f: Fn, mk: Micro, total, bias, res, out, last_active: int) -> None:
    """The last K block: bias and residual added in the registers and the result stored
    (rounded) once; an activation goes through the tile once more (see _epilogue_pass)."""
    b, L, nv = f.b, mk.lanes, mk.nv
    c = f.args[2]
    bias_v = [simd.load_any(b, bias, v * L, L, min(L, mk.cols - v * L)) if mk.bias else None
              for v in range(nv)]
    act = mk.epilogue != "none"
    dtype = mk.out_dtype
    for r in range(mk.mr):
        for v in range(nv):
            x = total[r][v]
            active = last_active if v == nv - 1 else L
            if mk.bias:
                x = b.fadd(x, bias_v[v])
            if act:
                _store_c(b, x, c, r * mk.ldc + v * L, last_active, v == nv - 1)
                continue
            oidx = const(i64, r * mk.ld_out + v * L)
            if mk.residual:
                x = b.fadd(x, bf16.load_as(b, dtype, res, oidx, L, active))
            bf16.store_as(b, dtype, x, out, oidx, active, native=mk.dot == "dpbf16")
    if act:
        _epilogue_pass(f, mk, c, res, out, last_active)


def _epilogue_planes(f: Fn, mk: Micro, total, bias, res, out, last_active: int) -> None:
    """The last K block of a tile of x rows' planes (module doc): each row's ``planes`` int32
    sums combined in the registers (gemm_lowbit_vnni.combine_planes), then the epilogue of the
    ``mr / planes`` x rows."""
    b, L, nv, count = f.b, mk.lanes, mk.nv, mk.planes
    heads, scale, qsum = f.args[8:11]
    vt = simd.vty(L)
    active = [last_active if v == nv - 1 else L for v in range(nv)]
    scales = [simd.load_any(b, scale, const(i64, v * L), L, active[v]) for v in range(nv)]
    qsums = [b.sitofp(simd.load_any(b, qsum, const(i64, v * L), L, active[v], elem=i32), vt)
             for v in range(nv)]
    rows = []
    for g in range(mk.mr // count):
        factor = load_factor(b, simd.gep(b, heads, const(i64, g * HEAD), i8), L)
        rows.append([combine_planes(b, [b.sitofp(total[g * count + p][v], vt)
                                        for p in range(count)], qsums[v], factor, scales[v],
                                    count) for v in range(nv)])
    _epilogue(f, replace(mk, mr=len(rows)), rows, bias, res, out, last_active)


def _grouped(f: Fn, mk: Micro, a, bp, c, kc, mode, bias, res, out) -> None:
    """The whole of a ``grouped`` tile (module doc): per group of ``GROUP_QUADS`` k quads (panel
    rows, then the group's sums of q and scales), each plane's int32 sums from zero, combined
    as ``S0 + 2**8 S1 (+ 2**16 S2) - 2**(8 planes - 1) sum q`` in wrapping int32 (exact: the
    true value fits), converted and FMA'd by the group's scales into float32 sums per x row;
    the last K block multiplies them by the rows' factors and runs the epilogue."""
    b, L, nv, count = f.b, mk.lanes, mk.nv, mk.planes
    rows = mk.mr // count
    vt, it = simd.vty(L), simd.vty(L, i32)
    zero = ir.Constant(it, [0] * L)
    last_active = mk.cols - (nv - 1) * L
    acc = [[[f.var(it, zero, f"acc_{r}_{v}") for v in range(nv)] for r in range(mk.mr)]]
    sums = [[f.var(vt, vmath.splat(vt, 0.0), f"sum_{g}_{v}") for v in range(nv)]
            for g in range(rows)]
    first = b.icmp_unsigned("!=", b.and_(mode, const(i64, FIRST)), const(i64, 0))
    with f.if_(b.not_(first)):
        for g in range(rows):
            for v in range(nv):
                sums[g][v].set(_load_c(b, c, g * mk.ldc + v * L, L, last_active, v == nv - 1))
    step = _word_step(f, mk, a, bp, acc)

    def shl(x, bits: int):
        return b.shl(x, ir.Constant(it, [bits] * L))

    with f.for_range(0, b.sdiv(kc, const(i64, GROUP_QUADS)), name="kg") as grp:
        for row in acc[0]:
            for x in row:
                x.set(zero)
        row0 = b.mul(grp, const(i64, GROUP_ROWS))
        for i in range(GROUP_QUADS):
            step(b.add(b.mul(grp, const(i64, GROUP_QUADS)), const(i64, i)), 0,
                 b.add(row0, const(i64, i)))
        qrow = b.mul(b.add(row0, const(i64, GROUP_QUADS)), const(i64, mk.ldb))
        srow = b.add(qrow, const(i64, mk.ldb))
        for v in range(nv):
            offset = shl(simd.load_vec(b, bp, b.add(qrow, const(i64, v * L)), L, elem=i32),
                         8 * count - 1)
            scale = simd.load_vec(b, bp, b.add(srow, const(i64, v * L)), L)
            for g in range(rows):
                planes = [acc[0][g * count + p][v].get() for p in range(count)]
                t = planes[0]
                for p in range(1, count):
                    t = b.add(t, shl(planes[p], 8 * p))
                t = b.sitofp(b.sub(t, offset), vt)
                sums[g][v].set(vmath.fma(b, t, scale, sums[g][v].get()))

    is_last = b.icmp_unsigned("!=", b.and_(mode, const(i64, LAST)), const(i64, 0))
    with f.if_else(is_last) as (then, otherwise):
        with then:
            heads = f.args[8]
            total = []
            for g in range(rows):
                factor = load_factor(b, simd.gep(b, heads, const(i64, g * HEAD), i8), L)
                total.append([b.fmul(sums[g][v].get(), factor) for v in range(nv)])
            _epilogue(f, replace(mk, mr=rows), total, bias, res, out, last_active)
        with otherwise:
            for g in range(rows):
                for v in range(nv):
                    _store_c(b, sums[g][v].get(), c, g * mk.ldc + v * L, last_active,
                             v == nv - 1)


def _screen(f: Fn, mk: Micro, total, c, thr, last_active: int) -> ir.Value:
    """Store the float32 tile to ``c`` if any valid lane may beat its row's ``thr`` (module
    doc); the i64 mask of such rows. One branch per tile: the common case stores nothing."""
    b, L, nv = f.b, mk.lanes, mk.nv
    op = ">" if mk.screen > 0 else "<"
    rows = const(i64, 0)
    for r in range(mk.mr):
        t = simd.broadcast(b, simd.load_scalar(b, thr, const(i64, r)), L)
        hits = None
        for v in range(nv):
            h = b.fcmp_unordered(op, total[r][v], t)
            if v == nv - 1 and last_active < L:
                h = b.and_(h, simd.const_mask(L, last_active))
            hits = h if hits is None else b.or_(hits, h)
        hit = b.icmp_unsigned("!=", b.bitcast(hits, ir.IntType(L)), ir.Constant(ir.IntType(L), 0))
        rows = b.or_(rows, b.shl(b.zext(hit, i64), const(i64, r)))
    with f.if_(b.icmp_unsigned("!=", rows, const(i64, 0)), likely=False):
        for r in range(mk.mr):
            for v in range(nv):
                _store_c(b, total[r][v], c, r * mk.ldc + v * L, last_active, v == nv - 1)
    return rows


def _epilogue_pass(f: Fn, mk: Micro, c, res, out, last_active: int) -> None:
    """out = act(C) + residual over the stored tile, one row per iteration: the activation is
    emitted ``nv`` times instead of ``mr * nv`` times (compile time), at the cost of an L1
    round trip per vector. bf16: C is float32, the residual and out bf16 (rounded once) or
    float32 (``mk.out``)."""
    epilogue_rows(f, const(i64, mk.mr), mk.nv, mk.lanes, last_active, c, mk.ldc, out,
                  mk.ld_out, mk.epilogue, None, res if mk.residual else None,
                  mk.out_dtype, native=mk.dot == "dpbf16")


def epilogue_rows(f: Fn, rows: ir.Value, nv: int, lanes: int, last_active: int, c, ldc: int,
                  out, ldo: int, epilogue: str, bias, res, dtype: str, native: bool) -> None:
    """``out[r] = act(c[r] (+ bias)) (+ res[r])`` for the first ``rows`` rows of a float32 tile
    ``c`` (``nv`` vectors a row, the last with ``last_active`` lanes), rounded once to
    ``dtype``; ``bias`` (float32) and ``res`` (``dtype``, row stride ``ldo``) may be None."""
    b, L = f.b, lanes
    bias_v = [simd.load_any(b, bias, v * L, L, last_active if v == nv - 1 else L)
              for v in range(nv)] if bias is not None else None
    with f.for_range(0, rows, name="ep") as r:
        row = b.mul(r, const(i64, ldc))
        orow = b.mul(r, const(i64, ldo))
        for v in range(nv):
            active = last_active if v == nv - 1 else L
            x = simd.load_any(b, c, b.add(row, const(i64, v * L)), L, active)
            if bias_v is not None:
                x = b.fadd(x, bias_v[v])
            x = vmath.activation(b, epilogue, x, dtype == "bf16")
            oidx = b.add(orow, const(i64, v * L))
            if res is not None:
                x = b.fadd(x, bf16.load_as(b, dtype, res, oidx, L, active))
            bf16.store_as(b, dtype, x, out, oidx, active, native=native)


def epilogue_masked(b: ir.IRBuilder, x, bias, epilogue: str, res, out, at, mask, lanes: int,
                    dtype: str) -> None:
    """``out[at:] = act(x (+ bias)) (+ res[at:])`` for the lanes of a runtime ``mask``, rounded
    once to ``dtype``: the epilogue of one vector of a row whose length is known at call time.
    ``bias`` is a float32 vector or None, ``res`` (``dtype``) a pointer or None."""
    if bias is not None:
        x = b.fadd(x, bias)
    x = vmath.activation(b, epilogue, x, dtype == "bf16")
    if dtype == "bf16":
        if res is not None:
            x = b.fadd(x, bf16.load(b, res, at, lanes, mask=mask))
        bf16.store(b, x, out, at, mask=mask)
    else:
        if res is not None:
            x = b.fadd(x, simd.masked_load(b, res, at, mask, lanes))
        simd.masked_store(b, x, out, at, mask)


def _word_step(f: Fn, mk: Micro, a, bp, acc):
    """The step of a micro-kernel over 32-bit words (see the module doc): bf16 k pairs on
    ``vdpbf16ps`` (dpbf16) or widened to two FMAs (widen), int8 k quads on ``vpdpbusd`` (vnni).
    B's words of the step are loaded once, each row's A word broadcast."""
    b, L, nv, mr = f.b, mk.lanes, mk.nv, mk.mr
    wt = ir.VectorType(i32, L)
    ht = ir.VectorType(i16, 2 * L)
    if mk.dot == "dpbf16":
        dp = intrinsic(f.module, f"llvm.x86.avx512bf16.dpbf16ps.{L * 32}", simd.vty(L),
                       [simd.vty(L), ht, ht])

        def dot(acc_v, aw, bw):
            return b.call(dp, [acc_v, b.bitcast(aw, ht), b.bitcast(bw, ht)])
    elif mk.dot == "vnni":   # u8 A times s8 B into int32 sums
        dp = intrinsic(f.module, f"llvm.x86.avx512.vpdpbusd.{L * 32}", wt, [wt, wt, wt])

        def dot(acc_v, aw, bw):
            return b.call(dp, [acc_v, aw, bw])
    hi_mask = ir.Constant(wt, [ir.Constant(i32, -65536)] * L)
    sixteen = ir.Constant(wt, [ir.Constant(i32, 16)] * L)

    def halves(words):
        """(even-k, odd-k) float32 vectors of a vector of bf16 pairs."""
        return (b.bitcast(b.shl(words, sixteen), simd.vty(L)),
                b.bitcast(b.and_(words, hi_mask), simd.vty(L)))

    def step(k, s, row=None):
        """k step ``k`` into accumulator set ``s``, B's words from its row ``row`` (default
        ``k``)."""
        brow = b.mul(k if row is None else row, const(i64, mk.ldb))
        bw = [b.load(simd.gep(b, bp, b.add(brow, const(i64, v * L)), i32), typ=wt, align=4)
              for v in range(nv)]
        if mk.dot == "widen":
            bh = [halves(w) for w in bw]
        abase = b.mul(k, const(i64, mk.a_ks))
        for r in range(mr):
            word = simd.load_scalar(b, a, b.add(abase, const(i64, r * mk.a_rs)), i32)
            aw = simd.broadcast(b, word, L)
            if mk.dot == "widen":
                a_even, a_odd = halves(aw)
                for v in range(nv):
                    x = vmath.fma(b, a_even, bh[v][0], acc[s][r][v].get())
                    acc[s][r][v].set(vmath.fma(b, a_odd, bh[v][1], x))
            else:
                for v in range(nv):
                    acc[s][r][v].set(dot(acc[s][r][v].get(), aw, bw[v]))
    return step


def _load_c(b, base, index: int, lanes: int, last_active: int, is_last: bool):
    active = last_active if is_last else lanes
    return simd.load_any(b, base, const(i64, index), lanes, active)


def _store_c(b, value, base, index: int, last_active: int, is_last: bool) -> None:
    active = last_active if is_last else value.type.count
    simd.store_any(b, value, base, const(i64, index), active)


def tile_shape(mr: int, nr: int, lanes: int) -> tuple[int, int]:
    """(rows, vectors) of a tile; ``nr`` must be a multiple of the lane count."""
    if nr % lanes:
        raise ValueError(f"panel width {nr} is not a multiple of {lanes} lanes")
    return mr, nr // lanes


__all__ = ["FIRST", "LAST", "Micro", "emit_micro", "epilogue_rows", "f32", "tile_shape"]
