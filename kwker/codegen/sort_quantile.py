"""quantile, nanquantile (§8.2): sorted positions, then ATen's rank and interpolation arithmetic.

Only the sign of a zero and which NaN payload is picked depend on the tie order, so most rows
need no sort: each position's key is selected from buckets of the top key bits.
Fast-math: none, except the interpolation's explicit FMA, which is ATen's own arithmetic.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, f32, f64, i1, i32, i64, ptr
from .sort_rows import SELECT_BUCKETS, SLOTS, RowKernel

INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")  # argument p2 indexes this
SHORT_QUANTILE_ROW = 256


def emit_quantile(rk: RowKernel, nan_ignoring: bool):
    """§8.2: the keys at the rank's positions, then ATen's rank and FMA interpolation
    arithmetic in the dtype.

    Tie order changes only the sign of a zero and which NaN (payload) is picked, so each
    position's key is selected from buckets of the top key bits (every bucket a quantile reads
    gathered in one pass over the row), without a sort, in every row
    except short ones and those holding both zeros, or NaNs of different bit patterns where a
    NaN is picked (quantile with any NaN; nanquantile of an all-NaN row): those take the exact
    std::sort emulation.
    """
    f, b = rk.f, rk.f.b
    T = rk.vt
    K, I, K2, I2, H = rk.scratch_arrays(["K", "I", "K2", "I2", "H"])
    zero, one = const(i64, 0), const(i64, 1)
    q_ptr = f.arg_ptr(rk.args, SLOTS["p0"])
    nq, interp, q_stride = rk.a["p1"], rk.a["p2"], rk.a["p3"]
    nnan = f.var(i64, zero, "nnan")
    pz, nz = f.var(i1, const(i1, 0), "pz"), f.var(i1, const(i1, 0), "nz")
    ity = rk.kt
    top, bottom = (1 << (ity.width - 1)) - 1, -(1 << (ity.width - 1))
    nan_lo, nan_hi = f.var(ity, const(ity, top), "nan_lo"), f.var(ity, const(ity, bottom), "nan_hi")
    with f.for_range(zero, rk.n, name="fill") as j:
        v = f.load(T, rk.src, j)
        k = rk.key(v)
        f.store(k, K, j)
        f.store(b.trunc(j, i32), I, j)
        is_nan = b.icmp_signed("==", k, rk.nan_key())
        nnan.set(b.add(nnan.get(), b.zext(is_nan, i64)))
        bits = b.bitcast(v, ity)
        lo_b, hi_b = nan_lo.get(), nan_hi.get()
        nan_lo.set(b.select(b.and_(is_nan, b.icmp_signed("<", bits, lo_b)), bits, lo_b))
        nan_hi.set(b.select(b.and_(is_nan, b.icmp_signed(">", bits, hi_b)), bits, hi_b))
        is_zero = b.fcmp_ordered("==", v, ir.Constant(T, 0.0))
        neg = b.icmp_signed("<", bits, const(ity, 0))
        pz.set(b.or_(pz.get(), b.and_(is_zero, b.not_(neg))))
        nz.set(b.or_(nz.get(), b.and_(is_zero, neg)))
    nan_picked = (b.icmp_signed("==", nnan.get(), rk.n) if nan_ignoring
                  else b.icmp_signed(">", nnan.get(), zero))
    mixed_nans = b.icmp_signed("<", nan_lo.get(), nan_hi.get())
    exact = b.or_(b.and_(nan_picked, mixed_nans), b.and_(pz.get(), nz.get()))
    # short rows: sorting costs less than clearing and scanning the bucket table
    exact = b.or_(exact, b.icmp_signed("<=", rk.n, const(i64, SHORT_QUANTILE_ROW)))
    n_t = b.sitofp(b.sub(rk.n, one), T)
    c_t = b.sitofp(b.sub(b.sub(rk.n, nnan.get()), one), T)
    has_nan = b.icmp_signed(">", nnan.get(), zero)
    tys = {f32: "f32", f64: "f64"}[T]

    def ranks(qi):
        """(rank, its floor/ceil/nearest as the interpolation picks, the position read first,
        the position read second when interpolating) of quantile ``qi``: ATen's arithmetic."""
        q = f.load(T, q_ptr, qi)
        if nan_ignoring:
            rank = b.fmul(q, c_t)
            rank = b.select(b.fcmp_ordered("<", rank, ir.Constant(T, 0.0)),
                            ir.Constant(T, 0.0), rank)
        else:
            rank = b.select(has_nan, n_t, b.fmul(q, n_t))
        r_floor = f.call_intrinsic(f"llvm.floor.{tys}", T, [rank])
        r_ceil = f.call_intrinsic(f"llvm.ceil.{tys}", T, [rank])
        r_near = f.call_intrinsic(f"llvm.roundeven.{tys}", T, [rank])
        sel = b.select(b.icmp_signed("==", interp, const(i64, 1)), r_floor, rank)
        sel = b.select(b.icmp_signed("==", interp, const(i64, 2)), r_ceil, sel)
        sel = b.select(b.icmp_signed("==", interp, const(i64, 4)), r_near, sel)
        return rank, b.fptosi(sel, i64), b.fptosi(r_ceil, i64)

    def every_position(use):
        with f.for_range(zero, nq, name="qpos") as qi:
            _, lo, hi = ranks(qi)
            use(lo)
            use(hi)
    with f.if_else(exact) as (slow, fast):
        with slow:
            b.call(rk.algos().std_sort(), [K, I, zero, rk.n])
        with fast:
            bucket_starts(rk, K, H)
            _gather_buckets(rk, K, K2, H, every_position)
    bucket_of = _emit_bucket_of(rk)
    nth = rk.algos().nth_element()
    zero_bits = b.select(pz.get(), const(ity, 0), const(ity, -(1 << (ity.width - 1))))

    def S(pos):
        """The value at sorted position ``pos``: read through the exact sort's indices, or
        selected by key (keys map back to bits exactly; ±0 and NaN as the row holds them)."""
        out = f.var(T, ir.Constant(T, 0.0), "S")
        with f.if_else(exact) as (slow, fast):
            with slow:
                out.set(f.load(T, rk.src, b.sext(f.load(i32, I, pos), i64)))
            with fast:  # introselect within the gathered bucket
                bk = b.call(bucket_of, [H, pos])
                b.call(nth, [K2, I2, f.load(i64, H, bk), pos,
                             f.load(i64, H, b.add(bk, one))])
                k = f.load(ity, K2, pos)
                maxpos = const(ity, (1 << (ity.width - 1)) - 1)
                bits = b.xor(k, b.and_(b.ashr(k, const(ity, ity.width - 1)), maxpos))
                bits = b.select(b.icmp_signed("==", k, const(ity, 0)), zero_bits, bits)
                bits = b.select(b.icmp_signed("==", k, rk.nan_key()), nan_lo.get(), bits)
                out.set(b.bitcast(bits, T))
        return out.get()
    with f.for_range(zero, nq, name="q") as qi:
        rank, lo, hi = ranks(qi)
        out = f.var(T, S(lo), "out")
        lerp = b.or_(b.icmp_signed("==", interp, const(i64, 0)),
                     b.icmp_signed("==", interp, const(i64, 3)))
        with f.if_(lerp):
            w = b.select(b.icmp_signed("==", interp, const(i64, 3)), ir.Constant(T, 0.5),
                         b.fsub(rank, b.sitofp(lo, T)))
            s, e = out.get(), S(hi)
            d = b.fsub(e, s)
            small = b.fcmp_ordered("<", f.call_intrinsic(f"llvm.fabs.{tys}", T, [w]),
                                   ir.Constant(T, 0.5))
            fma = f"llvm.fma.{tys}"
            near_s = f.call_intrinsic(fma, T, [w, d, s])
            near_e = f.call_intrinsic(fma, T, [b.fsub(w, ir.Constant(T, 1.0)), d, e])
            out.set(b.select(small, near_s, near_e))
        pos = b.add(b.mul(qi, q_stride), b.mul(rk.row, rk.a["out_v_rs"]))
        f.store(out.get(), rk.a["out_v"], pos)


def bucket_starts(rk: RowKernel, K, H, state=None):
    """H[b] = the first sorted position of bucket b (the top 11 key bits) of the keys in K. With
    ``state`` (2 x i64, ``emit_bucket_select``'s cache), marks no bucket gathered yet."""
    f, b = rk.f, rk.f.b
    zero, one = const(i64, 0), const(i64, 1)
    with f.for_range(0, SELECT_BUCKETS + 1, name="hz") as z:
        f.store(zero, H, z)
    with f.for_range(zero, rk.n, name="hist") as j:
        slot = b.add(_bucket(rk, f.load(rk.kt, K, j)), one)
        f.store(b.add(f.load(i64, H, slot), one), H, slot)
    with f.for_range(1, SELECT_BUCKETS + 1, name="starts") as z:
        f.store(b.add(f.load(i64, H, z), f.load(i64, H, b.sub(z, one))), H, z)
    if state is not None:
        f.store(const(i64, -1), state, zero)


def _bucket(rk: RowKernel, key):
    kt, b = rk.kt, rk.f.b
    d = b.lshr(b.xor(key, const(kt, 1 << (kt.width - 1))), const(kt, kt.width - 11))
    return b.zext(d, i64) if kt.width < 64 else d


def _emit_bucket_of(rk: RowKernel) -> ir.Function:
    """bucket_of(starts, pos) -> the bucket holding sorted position ``pos`` (the last bucket
    starting at or before it, which is not empty)."""
    name = f"{rk.spec.symbol}.bucket_of"
    if name in {fn.name for fn in rk.m.functions}:
        return rk.m.get_global(name)
    f = Fn(rk.m, name, i64, [ptr, i64], ["starts", "pos"])
    H, pos = f.args
    b = f.b
    one = const(i64, 1)
    lo, hi = f.var(i64, const(i64, 0), "lo"), f.var(i64, const(i64, SELECT_BUCKETS), "hi")
    with f.while_(lambda: b.icmp_signed(">", b.sub(hi.get(), lo.get()), one)):
        mid = b.sdiv(b.add(lo.get(), hi.get()), const(i64, 2))
        with f.if_else(b.icmp_signed("<=", f.load(i64, H, mid), pos)) as (up, down):
            with up:
                lo.set(mid)
            with down:
                hi.set(mid)
    f.ret(lo.get())
    return f.finish()


def _gather_buckets(rk: RowKernel, K, C, H, positions):
    """One pass over K puts the keys of every bucket holding one of ``positions`` (a function
    emitting a loop that calls its argument with each position) at that bucket's own sorted
    range of C, so ``C[starts[b]:starts[b + 1]]`` holds bucket b: one pass for all of a row's
    quantiles instead of one per bucket. The cursors live past the starts in H."""
    f, b = rk.f, rk.f.b
    cursor = f.gep(H, const(i64, SELECT_BUCKETS + 1), i64)
    with f.for_range(0, SELECT_BUCKETS, name="cz") as z:
        f.store(const(i64, -1), cursor, z)
    bucket_of = _emit_bucket_of(rk)

    def want(pos):
        bk = b.call(bucket_of, [H, pos])
        f.store(f.load(i64, H, bk), cursor, bk)
    positions(want)
    with f.for_range(const(i64, 0), rk.n, name="gather") as j:
        k = f.load(rk.kt, K, j)
        bk = _bucket(rk, k)
        c = f.load(i64, cursor, bk)
        with f.if_(b.icmp_signed(">=", c, const(i64, 0))):
            f.store(k, C, c)
            f.store(b.add(c, const(i64, 1)), cursor, bk)


def emit_bucket_select(rk: RowKernel) -> ir.Function:
    """select(K, C, D, starts, n, pos, cache) -> the key at sorted position ``pos``.

    The bucket holding ``pos`` is gathered into C (once: consecutive positions of one bucket
    reuse it) and introselected there; any selection gives the same key. K is left as it is.
    """
    name = f"{rk.spec.symbol}.select"
    if name in {fn.name for fn in rk.m.functions}:
        return rk.m.get_global(name)
    outer = rk.f
    f = Fn(rk.m, name, rk.kt, [ptr, ptr, ptr, ptr, i64, i64, ptr],
           ["K", "C", "D", "starts", "n", "pos", "cache"])
    K, C, D, H, n, pos, cache = f.args
    b = f.b
    zero, one = const(i64, 0), const(i64, 1)
    bucket = b.call(_emit_bucket_of(rk), [H, pos])
    with f.if_(b.icmp_signed("!=", f.load(i64, cache, zero), bucket)):
        m = f.var(i64, zero, "m")
        rk.f = f  # _bucket emits into this function
        with f.for_range(zero, n, name="gather") as j:
            k = f.load(rk.kt, K, j)
            with f.if_(b.icmp_signed("==", _bucket(rk, k), bucket)):
                f.store(k, C, m.get())
                m.set(b.add(m.get(), one))
        rk.f = outer
        f.store(bucket, cache, zero)
        f.store(m.get(), cache, one)
    off = b.sub(pos, f.load(i64, H, bucket))
    b.call(rk.algos().nth_element(), [C, D, zero, off, f.load(i64, cache, one)])
    f.ret(f.load(rk.kt, C, off))
    return f.finish()
