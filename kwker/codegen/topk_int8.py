"""int8 screening for the fused scoring + top-k at few rows (``approx="int8"``).

At one to four query rows the screening is bound by the bytes it reads, not by arithmetic: int8
weights (one byte per weight, a float32 scale per column) halve what bf16 reads. Each query row
is quantised per call (``emit_pack_int8``), the approximate scores come from ``vpdpbusd``
(``emit_micro_int8``, AVX512_VNNI: every CPU with AVX512_BF16 has it), and a column passes
the screen unless its approximation plus a rigorous bound of the error (derived in
``emit_pack_int8``) falls short of the row's heap root. Survivors are rescored in float32 as the
other paths rescore them, so the results are exact.

``Deferred`` (below) is the fast path of every screened kernel whose rows fit one row tile (and
of the generic kernel at one row): screen all columns first, rescore only the few that can still
make the top k, and hand over to the exact path only when ties or NaN make the answer depend on
ATen's heap order.
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .gemm_bf16 import emit_dot, emit_micro_bf16, emit_pack_bf16
from .irutil import Fn, const, defined, f32, i1, i32, i64, intrinsic, ptr, void


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


MAX_INT8_K = 1024  # |q8 . w8| <= K 127^2 must stay below 2^24 (exact in float32)
I32x16 = ir.VectorType(i32, 16)
F64 = ir.DoubleType()


def emit_micro_int8(module: ir.Module, mr: int, nv: int, nr: int, kq: int) -> ir.Function:
    """``void ukq(ptr a, ptr b, ptr c)``: C[mr x nr] (int32) = A B over ``kq`` k quads with
    ``vpdpbusd``: ``a`` words ``a[p * mr + r]`` (4 signed bytes), ``b`` panel words
    ``b[p * nr + j]`` (4 unsigned bytes). Few accumulators: k split into partial sums."""
    split = 2 if mr * nv <= 4 and kq % 2 == 0 else 1
    name = f"ukq.{mr}x{nv}.{nr}.{kq}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, ptr, ptr], ["a", "b", "c"])
    f.fn.attributes.add("noinline")
    a, bp, c = f.args
    b = f.b
    dp = intrinsic(module, "llvm.x86.avx512.vpdpbusd.512", I32x16, [I32x16] * 3)
    zero = ir.Constant(I32x16, [0] * 16)
    acc = [[[f.var(I32x16, zero, f"acc{h}_{r}_{v}") for v in range(nv)] for r in range(mr)]
           for h in range(split)]
    with f.for_range(0, kq // split, name="p") as p0:
        for h in range(split):
            p = b.add(b.mul(p0, const(i64, split)), const(i64, h))
            row = b.mul(p, const(i64, nr))
            bv = [b.load(simd.gep(b, bp, b.add(row, const(i64, 16 * v)), i32), typ=I32x16,
                         align=4) for v in range(nv)]
            for r in range(mr):
                word = simd.load_scalar(b, a, b.add(b.mul(p, const(i64, mr)), const(i64, r)), i32)
                av = simd.broadcast(b, word, 16)
                for v in range(nv):
                    acc[h][r][v].set(b.call(dp, [acc[h][r][v].get(), bv[v], av]))
    for r in range(mr):
        for v in range(nv):
            total = acc[0][r][v].get()
            for h in range(1, split):
                total = b.add(total, acc[h][r][v].get())
            b.store(total, simd.gep(b, c, const(i64, r * nr + 16 * v), i32), align=4)
    return f.finish()


def emit_pack_int8(module: ir.Module, mr: int, k: int, row_words: int = 0) -> ir.Function:
    """``void pack_int8(ptr x, i64 rows, ptr dst, ptr qinfo)``: rows of a (rows, k) float32
    matrix quantised to q8 = round(x / t) in [-127, 127], t = max(max|x|/127, 2^-100), packed
    as ``mr``-row tiles of 4-byte words ``dst[p * mr + r]`` (zero past ``rows`` and ``k``), and
    per row ``qinfo[4 r ..]`` = (t, alpha, beta, 128 sum q8 as int32). ``row_words``: rows of
    that many words instead, ``dst[r * row_words + p]`` (matrix tiles' A operand), every row of
    the ``mr``-row tiles that hold ``rows``.

    The bound: with q^ = t q8 and w^_j = s_j w8_j (as reals), the float32 rescored score s'
    (emit_dot) and approx = fl(fl(D s_j) t) obey
    |s' - approx| <= |q| |w - w^| + |q - q^| |w^| + g |q| |w| + 2^-23 |q^| |w^| + underflow,
    g = 1.01 K 2^-24 (the float32 dot product); with |w| <= E1 + E2, |q^| <= |q| + |q - q^|:
    <= alpha E1 + beta E2 + slack, alpha = |q| (1 + g), beta = |q - q^| (1 + 2^-22) +
    |q| (g + 2^-22), each rounded up with 2^-20 to spare for the float32 evaluation; norms
    are summed in float64 (no underflow), and (K + 64) 2^-122 covers underflow and flushing
    (every stored factor is a normal float). |q| > 2^60, inf or NaN: alpha is NaN and every
    lane passes. s' > root implies fl(approx + e) > root: rounding is monotone."""
    name = f"pack_int8.{mr}.{k}" + (f".r{row_words}" if row_words else "")
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, ptr, ptr], ["x", "rows", "dst", "qinfo"])
    f.fn.attributes.add("noinline")
    x, rows, dst, qinfo = f.args
    b = f.b
    kq = _cdiv(k, 4)
    g = 1.01 * k * 2.0 ** -24
    zero64 = ir.Constant(F64, 0.0)
    padded_rows = const(i64, mr)
    if row_words:  # every row of the tiles that hold ``rows``
        tiles = b.udiv(b.add(rows, const(i64, mr - 1)), const(i64, mr))
        padded_rows = b.mul(tiles, const(i64, mr))

    def word_at(p, r):
        return b.add(b.mul(r, const(i64, row_words)), p) if row_words else \
            b.add(b.mul(p, const(i64, mr)), r)
    with f.for_range(0, padded_rows, name="r") as r:
        real = b.icmp_signed("<", r, rows)
        with f.if_else(real) as (yes, no):
            with yes:
                xr = simd.gep(b, x, b.mul(r, const(i64, k)))
                amax = f.var(f32, ir.Constant(f32, 0.0), "amax")
                ss = f.var(F64, zero64, "ss")
                with f.for_range(0, k, name="i") as i:
                    xi = simd.load_scalar(b, xr, i)
                    ax = f.call_intrinsic("llvm.fabs.f32", f32, [xi])
                    amax.set(b.select(b.fcmp_ordered(">", ax, amax.get()), ax, amax.get()))
                    xd = b.fpext(xi, F64)
                    ss.set(b.fadd(ss.get(), b.fmul(xd, xd)))
                t = b.fdiv(amax.get(), ir.Constant(f32, 127.0))
                t = b.select(b.fcmp_ordered("<", t, ir.Constant(f32, 2.0 ** -100)),
                             ir.Constant(f32, 2.0 ** -100), t)
                inv = b.fdiv(ir.Constant(f32, 1.0), t)
                t64 = b.fpext(t, F64)
                dd = f.var(F64, zero64, "dd")
                csum = f.var(i32, const(i32, 0), "csum")

                def quant(idx):
                    xi = simd.load_scalar(b, xr, idx)
                    v = f.call_intrinsic("llvm.rint.f32", f32, [b.fmul(xi, inv)])
                    v = f.call_intrinsic("llvm.maxnum.f32", f32, [v, ir.Constant(f32, -127.0)])
                    v = f.call_intrinsic("llvm.minnum.f32", f32, [v, ir.Constant(f32, 127.0)])
                    qi = b.fptosi(v, i32)
                    diff = b.fsub(b.fpext(xi, F64), b.fmul(t64, b.sitofp(qi, F64)))
                    dd.set(b.fadd(dd.get(), b.fmul(diff, diff)))
                    csum.set(b.add(csum.get(), qi))
                    return b.and_(qi, const(i32, 255))

                def store_word(p, idxs):
                    word = const(i32, 0)
                    for j, idx in enumerate(idxs):
                        word = b.or_(word, b.shl(quant(idx), const(i32, 8 * j)))
                    simd.store_scalar(b, word, dst, word_at(p, r))

                with f.for_range(0, k // 4, name="p") as p:
                    store_word(p, [b.add(b.mul(p, const(i64, 4)), const(i64, j))
                                   for j in range(4)])
                if k % 4:
                    store_word(const(i64, k // 4), [const(i64, 4 * (k // 4) + j)
                                                    for j in range(k % 4)])
                for p in range(kq, row_words):  # the tile step's zero tail
                    simd.store_scalar(b, const(i32, 0), dst, word_at(const(i64, p), r))
                qn = f.call_intrinsic("llvm.sqrt.f64", F64, [ss.get()])
                dn = f.call_intrinsic("llvm.sqrt.f64", F64, [dd.get()])

                def up(v):  # float32 >= v (v >= 0, not NaN), never subnormal
                    v = b.fmul(v, ir.Constant(F64, 1 + 2.0 ** -20))
                    v = f.call_intrinsic("llvm.maxnum.f64", F64, [v, ir.Constant(F64, 2.0 ** -126)])
                    return b.fptrunc(v, f32)

                alpha = up(b.fmul(qn, ir.Constant(F64, 1 + g)))
                beta = up(b.fadd(b.fmul(dn, ir.Constant(F64, 1 + 2.0 ** -22)),
                                 b.fmul(qn, ir.Constant(F64, g + 2.0 ** -22))))
                ok = b.fcmp_ordered("<=", qn, ir.Constant(F64, 2.0 ** 60))
                alpha = b.select(ok, alpha, ir.Constant(f32, float("nan")))
                info = simd.gep(b, qinfo, b.mul(r, const(i64, 4)))
                for j, val in enumerate((t, alpha, beta)):
                    simd.store_scalar(b, val, info, const(i64, j))
                simd.store_scalar(b, b.mul(csum.get(), const(i32, 128)), info, const(i64, 3))
            with no, f.for_range(0, max(kq, row_words), name="z") as p:
                simd.store_scalar(b, const(i32, 0), dst, word_at(p, r))
    return f.finish()


# -- deferred rescoring: one row tile, screen everything first ---------------------------------
CAND_MIN = 256  # candidates a (thread, row) keeps at least; past its capacity: the exact path
STACK_BYTES = 32768  # scratch up to this size lives on the stack (no malloc per call)
I8 = ir.IntType(8)


def _align64(b: ir.IRBuilder, raw: ir.Value) -> ir.Value:
    addr = b.ptrtoint(raw, i64)
    pad = b.and_(b.sub(const(i64, 64), b.and_(addr, const(i64, 63))), const(i64, 63))
    return b.gep(raw, [pad], inbounds=True, source_etype=I8)


def _byte(b: ir.IRBuilder, base: ir.Value, off) -> ir.Value:
    off = off if isinstance(off, ir.Value) else const(i64, off)
    return b.gep(base, [off], inbounds=True, source_etype=I8)


class Deferred:
    """``i1 fast(x, w, vals, idx, wexact, evec, nthreads)``: the top-k of ``m`` rows that fit
    one ``mr``-row tile (screened scores), or false when the exact path must run instead.

    Threads split the columns. Each (thread, row) screens its columns against T, the k-th best
    pessimistic bound P (approx - e; smallest: approx + e) seen so far, kept in a heap of k
    bounds: a column whose optimistic bound O (approx + e) falls short of T has k columns
    strictly better, so it is not in the top k, nor tied with it. The others are candidates
    (index, O), rescored only after the join, against the k-th best P of all threads: usually
    little more than k of them. Their top k is the answer when it is unambiguous: no NaN, k
    distinct values, and no other candidate equal to the k-th. Then the set is unique, every
    column left out is strictly worse, and its order is by value, as ATen's heap path gives
    it. Otherwise (ties, NaN, a candidate list past its capacity) false: the caller runs the
    exact path, whose heaps reproduce ATen's tie order.

    Scratch (stack, or malloc past STACK_BYTES): the packed x tile and its quantisation data,
    the exact heap, and per (thread, row) a record: header (candidates, P-heap count,
    overflow), candidate indices, candidate values (O, then the rescored score), P-heap
    values and indices.
    """

    def __init__(self, e, m: int, mr: int):
        self.e, self.m, self.mr = e, m, mr
        s = e.s
        self.kk = _cdiv(s.k, 16) * 16
        self.vec = s.k <= 16  # the k best P in one vector, else in a heap
        self.cap = _cdiv(max(CAND_MIN, 4 * s.k), 16) * 16
        self.rec = 64 + 8 * self.cap + 8 * self.kk
        self.a_bytes = _cdiv((mr * e.kwa + 4 * mr) * 4, 64) * 64
        self.name = f"{s.symbol}.fast{m}"
        self.body = self.emit_body()
        self.fn = self.emit_fast()

    def parts(self, b, recs, t, r):
        """(record, candidate indices, candidate values, P values, P indices) of (t, r)."""
        rp = _byte(b, recs, b.mul(b.add(b.mul(t, const(i64, self.m)), r),
                                  const(i64, self.rec)))
        cap, kk = self.cap, self.kk
        return (rp, _byte(b, rp, 64), _byte(b, rp, 64 + 4 * cap), _byte(b, rp, 64 + 8 * cap),
                _byte(b, rp, 64 + 8 * cap + 4 * kk))

    def threshold(self, b, rp, pv) -> ir.Value:
        """T: the k-th best P kept, or the worst value while fewer than k are kept."""
        if self.vec:
            return simd.load_scalar(b, rp, const(i64, 6))
        full = b.icmp_signed("==", simd.load_scalar(b, rp, const(i64, 1), i64),
                             const(i64, self.e.s.k))
        worst = ir.Constant(f32, float("-inf") if self.e.s.largest else float("inf"))
        return b.select(full, simd.load_scalar(b, pv, const(i64, 0)), worst)

    def insert(self, f, rp, pv, pi, p, col) -> None:
        """Keep P among the k best (NaN never). k <= 16: one vector of k slots, its worst
        lane replaced and T (at header word 6) its new minimum (largest; else maximum);
        larger k: ATen's heap (any heap would do), its count at header word 1."""
        b, s = f.b, self.e.s
        better = ">" if s.largest else "<"
        if not self.vec:
            cnt = simd.gep(b, rp, const(i64, 1), i64)
            filling = b.icmp_signed("<", b.load(cnt, typ=i64), const(i64, s.k))
            beats = b.fcmp_ordered(better, p, simd.load_scalar(b, pv, const(i64, 0)))
            with f.if_(b.and_(b.fcmp_ordered("ord", p, p), b.or_(filling, beats))):
                b.call(self.e.heap.push, [pv, pi, cnt, const(i64, s.k), p, col])
            return
        thr = simd.load_scalar(b, rp, const(i64, 6))
        with f.if_(b.fcmp_ordered(better, p, thr)):
            vt = simd.vty(16)
            vec = b.load(pv, typ=vt, align=64)
            at = b.fcmp_ordered("==", vec, simd.broadcast(b, thr, 16))
            lane = f.call_intrinsic("llvm.cttz.i16", ir.IntType(16),
                                    [b.bitcast(at, ir.IntType(16)), const(i1, 0)])
            vec = b.insert_element(vec, p, b.zext(lane, i32))
            b.store(vec, pv, align=64)
            worse = "<" if s.largest else ">"
            simd.store_scalar(b, simd._tree(b, vec, lambda x, y: b.select(
                b.fcmp_ordered(worse, x, y), x, y)), rp, const(i64, 6))

    def screen(self, b, approx, err):
        """(optimistic, pessimistic) bounds of the score."""
        hi, lo = b.fadd(approx, err), b.fsub(approx, err)
        return (hi, lo) if self.e.s.largest else (lo, hi)

    def emit_compact(self) -> ir.Function:
        """``compact(record, indices, values, T)``: drop the candidates T now rules out (they
        would not pass the merge either); if that frees less than a quarter of the list, mark
        the record overflowed (the exact path decides) and leave it full."""
        s = self.e.s
        f = Fn(self.e.module, self.name + ".compact", void, [ptr, ptr, ptr, f32],
               ["rp", "ci", "cv", "thr"])
        f.fn.attributes.add("noinline")
        rp, ci, cv, thr = f.args
        b = f.b
        kept = f.var(i64, const(i64, 0), "kept")
        with f.for_range(0, self.cap, name="j") as j:
            o = simd.load_scalar(b, cv, j)
            with f.if_(b.fcmp_unordered(">=" if s.largest else "<=", o, thr)):
                simd.store_scalar(b, simd.load_scalar(b, ci, j, i32), ci, kept.get())
                simd.store_scalar(b, o, cv, kept.get())
                kept.set(b.add(kept.get(), const(i64, 1)))
        with f.if_else(b.icmp_signed(">", kept.get(), const(i64, self.cap * 3 // 4))) as (
                full, freed):
            with full:
                simd.store_scalar(b, const(i64, 1), rp, const(i64, 2))
            with freed:
                simd.store_scalar(b, kept.get(), rp, const(i64, 0))
        return f.finish()

    def emit_body(self) -> ir.Function:
        """``body(ctx, tid, nt)``, ctx = x, ap, qinfo, w, evec, records, team."""
        e, s, m, mr = self.e, self.e.s, self.m, self.mr
        L, nr, kp = e.L, s.nr, e.kwa
        compact = self.emit_compact()
        f = Fn(e.module, self.name + ".body", void, [ptr, i64, i64], ["ctx", "tid", "nt"])
        b = f.b
        ctx, tid, nt = f.args
        ap, qinfo, w, ev, recs = (f.arg_ptr(ctx, j) for j in range(1, 6))
        with f.if_(b.icmp_signed("==", tid, const(i64, 0))):
            simd.store_scalar(b, nt, ctx, const(i64, 6))  # the team size the merge must use
        npan = const(i64, e.np)
        q0 = b.sdiv(b.mul(npan, tid), nt)
        q1 = b.sdiv(b.mul(npan, b.add(tid, const(i64, 1))), nt)
        tile = _align64(b, f.array(f32, mr * nr + 16, "tile"))
        o_arr, p_arr = f.array(f32, L, "o"), f.array(f32, L, "p")
        with f.for_range(0, m, name="init") as r:
            rp, _, _, pv, _ = self.parts(b, recs, tid, r)
            for j in range(3):
                simd.store_scalar(b, const(i64, 0), rp, const(i64, j))
            if self.vec:  # k slots at the worst value, the others never the worst
                inf = float("inf") if s.largest else float("-inf")
                b.store(ir.Constant(simd.vty(16), [-inf] * s.k + [inf] * (16 - s.k)), pv,
                        align=64)
                simd.store_scalar(b, ir.Constant(f32, -inf), rp, const(i64, 6))
        with f.for_range(q0, q1, name="q") as q:
            wq = simd.gep(b, w, b.mul(q, const(i64, kp * nr)), i32)
            if e.int8:
                b.call(emit_micro_int8(e.module, mr, nr // 16, nr, kp), [ap, wq, tile])
            else:
                b.call(emit_micro_bf16(e.module, mr, nr // 16, nr), [ap, wq, tile,
                                                                     const(i64, kp)])
            col0 = b.mul(q, const(i64, nr))
            cols = b.select(b.icmp_signed("==", q, const(i64, e.np - 1)),
                            const(i64, e.nr_edge), const(i64, nr))
            with f.for_range(0, m, name="r") as r:
                rp, ci, cv, pv, pi = self.parts(b, recs, tid, r)
                qn = simd.gep(b, qinfo, b.mul(r, const(i64, 4))) if e.int8 else \
                    simd.load_scalar(b, qinfo, r)
                setup = e.screen_setup(b, qn)
                row = simd.gep(b, tile, b.mul(r, const(i64, nr)))
                for v in range(nr // L):
                    live = simd.lane_mask(b, L, b.sub(cols, const(i64, v * L)))
                    opt, pes = self.screen(b, *e.screen_lanes(b, setup, row, ev, col0, v, live))
                    thr = self.threshold(b, rp, pv)
                    hit = b.fcmp_unordered(">=" if s.largest else "<=", opt,
                                           simd.broadcast(b, thr, L))
                    bits = b.zext(b.bitcast(b.and_(hit, live), ir.IntType(L)), i64)
                    word = f.var(i64, bits, "bits")
                    with f.if_(b.icmp_unsigned("!=", bits, const(i64, 0)), likely=False):
                        simd.store_vec(b, opt, o_arr, const(i64, 0))
                        simd.store_vec(b, pes, p_arr, const(i64, 0))
                    with f.while_(lambda w=word: b.icmp_unsigned("!=", w.get(), const(i64, 0))):
                        wv = word.get()
                        lane = f.call_intrinsic("llvm.cttz.i64", i64, [wv, const(i1, 0)])
                        word.set(b.and_(wv, b.sub(wv, const(i64, 1))))
                        col = b.trunc(b.add(col0, b.add(lane, const(i64, v * L))), i32)
                        at_cap = b.icmp_signed("==", simd.load_scalar(b, rp, const(i64, 0), i64),
                                               const(i64, self.cap))
                        fresh = b.icmp_signed("==", simd.load_scalar(b, rp, const(i64, 2), i64),
                                              const(i64, 0))
                        with f.if_(b.and_(at_cap, fresh), likely=False):
                            b.call(compact, [rp, ci, cv, self.threshold(b, rp, pv)])
                        n = simd.load_scalar(b, rp, const(i64, 0), i64)
                        with f.if_(b.icmp_signed("<", n, const(i64, self.cap))):
                            simd.store_scalar(b, col, ci, n)
                            simd.store_scalar(b, simd.load_scalar(b, o_arr, lane), cv, n)
                            simd.store_scalar(b, b.add(n, const(i64, 1)), rp, const(i64, 0))
                        self.insert(f, rp, pv, pi, simd.load_scalar(b, p_arr, lane), col)
        return f.finish()

    def emit_fast(self) -> ir.Function:
        e, s, m, mr = self.e, self.e.s, self.m, self.mr
        mod = e.module
        gomp = intrinsic(mod, "GOMP_parallel", void, [ptr, ptr, i32, i32])
        outlined = Fn(mod, self.name + ".omp", void, [ptr], ["ctx"])
        ob = outlined.b
        ob.call(self.body, [outlined.args[0],
                            ob.sext(ob.call(intrinsic(mod, "omp_get_thread_num", i32, []), []),
                                    i64),
                            ob.sext(ob.call(intrinsic(mod, "omp_get_num_threads", i32, []),
                                            []), i64)])
        outlined.finish()
        row = self.emit_row()
        f = Fn(mod, self.name, i1, [ptr] * 6 + [i64],
               ["x", "w", "vals", "idx", "wexact", "evec", "nthreads"])
        b = f.b
        x, w, vals, idx, wx, ev, nreq = f.args
        cap = max(1, min(e.np, 2 * m * s.n * s.k_dim >> 18))  # ~256 kflop per thread
        nt = b.select(b.icmp_signed("<", nreq, const(i64, cap)), nreq, const(i64, cap))
        nt = b.select(b.icmp_signed("<", nt, const(i64, 1)), const(i64, 1), nt)
        fixed = self.a_bytes + 8 * self.kk
        total = b.add(b.mul(nt, const(i64, m * self.rec)), const(i64, fixed))
        stack = f.array(I8, STACK_BYTES + 64, "scratch")
        on_heap = b.icmp_signed(">", total, const(i64, STACK_BYTES))
        raw = f.var(ptr, stack, "raw")
        with f.if_(on_heap, likely=False):
            raw.set(b.call(e.malloc, [b.add(total, const(i64, 64))]))
        base = _align64(b, raw.get())
        ap, qinfo = base, _byte(b, base, mr * e.kwa * 4)
        hv = _byte(b, base, self.a_bytes)
        hi = _byte(b, hv, 4 * self.kk)
        recs = _byte(b, base, fixed)
        pack = emit_pack_int8 if e.int8 else emit_pack_bf16
        b.call(pack(mod, mr, s.k_dim), [x, const(i64, m), ap, qinfo])
        ctx = f.array(i64, 8, "ctx")
        for slot, v in enumerate([x, ap, qinfo, w, ev, recs]):
            simd.store_scalar(b, b.ptrtoint(v, i64), ctx, const(i64, slot))
        with f.if_else(b.icmp_signed("<=", nt, const(i64, 1))) as (serial, par):
            with serial:
                b.call(self.body, [ctx, const(i64, 0), const(i64, 1)])
            with par:
                b.call(gomp, [outlined.fn, ctx, b.trunc(nt, i32), const(i32, 0)])
        team = simd.load_scalar(b, ctx, const(i64, 6), i64)
        ok = f.var(i1, const(i1, 1), "ok")
        with f.for_range(0, m, name="row") as r, \
                f.if_(b.not_(b.call(row, [r, team, recs, hv, hi, x, wx, vals, idx]))):
            ok.set(const(i1, 0))
            f.break_()
        with f.if_(on_heap, likely=False):
            b.call(e.free, [raw.get()])
        f.ret(ok.get())
        return f.finish()

    def emit_row(self) -> ir.Function:
        """``i1 row(r, team, recs, hv, hi, x, wx, vals, idx)``: merge row ``r`` of every
        thread, rescore its candidates and write its top k; false when the answer is
        ambiguous (see the class)."""
        e, s = self.e, self.e.s
        f = Fn(e.module, self.name + ".row", i1, [i64, i64] + [ptr] * 7,
               ["r", "team", "recs", "hv", "hi", "x", "wx", "vals", "idx"])
        r, team, recs, hv, hi, x, wx, vals, idx = f.args
        b, kd = f.b, s.k_dim
        k = const(i64, s.k)
        good = f.var(i1, const(i1, 1), "good")
        rp0, _, _, upv, upi = self.parts(b, recs, const(i64, 0), r)
        with f.for_range(0, team, name="t") as t:  # T: the k-th best P of all threads
            rp, _, _, pv, pi = self.parts(b, recs, t, r)
            with f.if_(b.icmp_signed("!=", simd.load_scalar(b, rp, const(i64, 2), i64),
                                     const(i64, 0))):
                good.set(const(i1, 0))
            count = k if self.vec else simd.load_scalar(b, rp, const(i64, 1), i64)
            with f.if_(b.icmp_signed(">", t, const(i64, 0))), \
                    f.for_range(0, count, name="j") as j:
                self.insert(f, rp0, upv, upi, simd.load_scalar(b, pv, j),
                            simd.load_scalar(b, pi, j, i32))
        ok = good.get()
        if not self.vec:  # the heap's root is a bound once it holds k
            ok = b.and_(ok, b.icmp_signed("==", simd.load_scalar(b, rp0, const(i64, 1), i64),
                                          k))
        with f.if_(b.not_(ok), likely=False):
            f.ret(const(i1, 0))
        thr = self.threshold(b, rp0, upv)
        cmp = ">=" if s.largest else "<="
        xrow = simd.gep(b, x, b.mul(r, const(i64, kd)))
        # keep the candidates that can reach T, then rescore them
        with f.for_range(0, team, name="t") as t:
            rp, ci, cv, _, _ = self.parts(b, recs, t, r)
            kept = f.var(i64, const(i64, 0), "kept")
            with f.for_range(0, simd.load_scalar(b, rp, const(i64, 0), i64), name="j") as j, \
                    f.if_(b.fcmp_unordered(cmp, simd.load_scalar(b, cv, j), thr)):
                c = simd.load_scalar(b, ci, j, i32)
                simd.store_scalar(b, c, ci, kept.get())
                kept.set(b.add(kept.get(), const(i64, 1)))
            simd.store_scalar(b, kept.get(), rp, const(i64, 0))
        ecnt = f.array(i64, 1, "ecnt")
        simd.store_scalar(b, const(i64, 0), ecnt, const(i64, 0))
        nan = f.var(i1, const(i1, 0), "nan")
        dot = emit_dot(e.module, kd, e.L)
        with f.for_range(0, team, name="t") as t:
            rp, ci, cv, _, _ = self.parts(b, recs, t, r)
            with f.for_range(0, simd.load_scalar(b, rp, const(i64, 0), i64), name="j") as j:
                c = simd.load_scalar(b, ci, j, i32)
                v = b.call(dot, [xrow, simd.gep(b, wx, b.mul(b.sext(c, i64), const(i64, kd)))])
                simd.store_scalar(b, v, cv, j)
                nan.set(b.or_(nan.get(), b.fcmp_unordered("uno", v, v)))
                b.call(e.heap.push, [hv, hi, ecnt, k, v, c])
        with f.if_(b.or_(nan.get(), b.icmp_signed("<", b.load(ecnt, typ=i64), k)), likely=False):
            f.ret(const(i1, 0))
        kth = simd.load_scalar(b, hv, const(i64, 0))
        reach = f.var(i64, const(i64, 0), "reach")  # rescored scores as good as the k-th
        with f.for_range(0, team, name="t") as t:
            rp, _, cv, _, _ = self.parts(b, recs, t, r)
            with f.for_range(0, simd.load_scalar(b, rp, const(i64, 0), i64), name="j") as j:
                hit = b.fcmp_ordered(cmp, simd.load_scalar(b, cv, j), kth)
                reach.set(b.add(reach.get(), b.zext(hit, i64)))
        with f.if_(b.icmp_signed("!=", reach.get(), k), likely=False):
            f.ret(const(i1, 0))
        e.emit_output(f, r, hv, hi, vals, idx)  # sorts the heap, best first
        with f.for_range(1, k, name="d") as j:  # k distinct values
            a, c = (simd.load_scalar(b, hv, b.sub(j, const(i64, d))) for d in (1, 0))
            with f.if_(b.not_(b.fcmp_ordered(">" if s.largest else "<", a, c)), likely=False):
                f.ret(const(i1, 0))
        f.ret(const(i1, 1))
        return f.finish()
