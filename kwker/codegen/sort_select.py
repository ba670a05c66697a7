"""The ops that pick from the row's order: topk (§4), kthvalue (§5), median (§6), mode (§7).

Each emulates the ATen algorithm that decides its tie order or, where the result is fixed
whatever the algorithm, runs a cheaper one; each emitter says which.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import HALF_FLOATS, const, f32, i1, i16, i32, i64, vec
from .sort_quantile import bucket_starts, emit_bucket_select
from .sort_rows import RowKernel
from .sortalgo import SortAlgos


def emit_topk(rk: RowKernel):
    """§4: heap path (k*64 <= n) with an exact vector pre-filter (§2.2), else the nth path.

    32-bit keys travel as packed (key << 32 | index) words, halving the moves of each sift.
    """
    f, b = rk.f, rk.f.b
    k, is_sorted = rk.a["p0"], rk.a["p1"]
    packed = rk.kt == i32
    if packed:
        P, = rk.scratch_arrays(["P"])
        K = I = P
    else:
        K, I = rk.scratch_arrays(["K", "I"])
    algos = rk.algos(packed=packed)
    zero = const(i64, 0)

    def element(j):
        key = rk.key(f.load(rk.vt, rk.src, j))
        if packed:
            return key, [b.or_(b.shl(b.sext(key, i64), const(i64, 32)), j)]
        return key, [key, b.trunc(j, i32)]
    heap = b.icmp_signed("<=", b.mul(k, const(i64, 64)), rk.n)
    with f.if_else(heap) as (heap_path, nth_path):
        with heap_path:
            with f.for_range(zero, k, name="init") as j:
                algos._put(f, K, I, j, element(j)[1])
            b.call(algos.make_heap(), [K, I, zero, k])
            sift = algos.sift_down()

            def offer(j):
                kj, elem = element(j)
                with f.if_(b.icmp_signed("<", kj, algos.key_at(f, K, zero))):
                    b.call(sift, [K, I, zero, zero, k, *elem])
            L = rk.lanes
            j = f.var(i64, k, "j")
            if packed and rk.vt == f32:
                _float_prefilter(rk, algos, K, j, offer)
            with f.while_(lambda: b.icmp_signed("<=", b.add(j.get(), const(i64, L)), rk.n)):
                keys = rk.key(f.load_vec(rk.vt, L, rk.src, j.get()))
                root = algos.key_at(f, K, zero)
                splat = b.insert_element(ir.Constant(vec(rk.kt, L), None), root, const(i32, 0))
                splat = b.shuffle_vector(splat, splat, ir.Constant(vec(i32, L), [0] * L))
                m = b.zext(b.bitcast(b.icmp_signed("<", keys, splat), ir.IntType(L)), i64)
                _offer_set_bits(rk, m, j.get(), offer)
                j.set(b.add(j.get(), const(i64, L)))
            with f.for_range(j.get(), rk.n, name="tail") as t:
                offer(t)
            b.call(algos.sort_heap(), [K, I, zero, k])
        with nth_path:
            if packed:
                rk.fill_packed(P)
            else:
                rk.fill_keys(K, I)
            km1 = b.sub(k, const(i64, 1))
            b.call(algos.nth_element(), [K, I, zero, km1, rk.n])
            with f.if_(b.icmp_signed("!=", is_sorted, zero)):
                b.call(algos.std_sort(), [K, I, zero, km1])
    if packed:
        rk.write_packed(P, k)
    else:
        rk.write_sorted(I, k)


PREFILTER_UNROLL = 4  # vectors tested per branch by the float pre-filter


def _float_prefilter(rk: RowKernel, algos: SortAlgos, K, j, offer):
    """The heap path's pre-filter on float32 values as they are, PREFILTER_UNROLL vectors per
    branch: an element is offered when it is beyond the root's value or either is NaN (``ugt``
    for the largest, ``ult`` for the smallest). That passes every element whose key goes before
    the root's (keys order floats with -0.0 == +0.0 and NaN beyond +inf, as float compares do
    apart from NaN, which passes), and ``offer`` compares keys exactly. No key transform per
    element: two instructions a vector instead of nine."""
    f, b = rk.f, rk.f.b
    L, U = rk.lanes, PREFILTER_UNROLL
    width = L * U
    assert width <= 64
    pred = "ugt" if rk.spec.descending else "ult"
    zero = const(i64, 0)
    with f.while_(lambda: b.icmp_signed("<=", b.add(j.get(), const(i64, width)), rk.n)):
        root = algos._get(f, K, None, zero)[0]
        rootv = f.load(f32, rk.src, b.and_(root, const(i64, 0xFFFFFFFF)))
        splat = b.insert_element(ir.Constant(vec(f32, L), None), rootv, const(i32, 0))
        splat = b.shuffle_vector(splat, splat, ir.Constant(vec(i32, L), [0] * L))
        mask = zero
        for u in range(U):
            v = f.load_vec(f32, L, rk.src, b.add(j.get(), const(i64, u * L)))
            bits = b.zext(b.bitcast(b.fcmp_unordered(pred, v, splat), ir.IntType(L)), i64)
            mask = b.or_(mask, b.shl(bits, const(i64, u * L)) if u else bits)
        _offer_set_bits(rk, mask, j.get(), offer)
        j.set(b.add(j.get(), const(i64, width)))


def _offer_set_bits(rk: RowKernel, mask, base, offer):
    """offer(base + t) for every set bit t of the i64 ``mask``, lowest first (index order)."""
    f, b = rk.f, rk.f.b
    zero = const(i64, 0)
    m = f.var(i64, mask, "mask")
    with f.while_(lambda: b.icmp_unsigned("!=", m.get(), zero)):
        t = f.call_intrinsic("llvm.cttz.i64", i64, [m.get(), const(i1, 0)])
        offer(b.add(base, t))
        m.set(b.and_(m.get(), b.sub(m.get(), const(i64, 1))))


def emit_kthvalue(rk: RowKernel):
    """§5. If the k-th key occurs once in the row, its value and index are fixed whatever the
    algorithm, so a selection finds it (``_select``); a tie at the k-th key needs ATen's own
    quickselect, step by step, on the keys as filled."""
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    rk.fill_keys(K, I)
    zero, one = const(i64, 0), const(i64, 1)
    k0 = rk.a["p0"]  # 0-based
    kv, less, same = _select(rk, K, I, k0)
    with f.if_else(b.icmp_signed("==", same, one)) as (unique, tied):
        with unique:
            rk.write(zero, _nth_occurrence(rk, K, kv, zero))
        with tied:
            with f.if_(b.icmp_signed("<=", rk.n, const(i64, SHORT_SELECT_ROW))):
                rk.fill_keys(K, I)  # the short rows' introselect permuted them
            b.call(rk.algos().aten_quickselect(), [K, I, rk.n, k0])
            rk.write(zero, b.sext(f.load(i32, I, k0), i64))


# rows up to this long select by introselect; longer ones from buckets of the top key bits
# (clearing and scanning the bucket table costs more than a short row's partitions)
SHORT_SELECT_ROW = 256


def _select(rk: RowKernel, K, I, pos):
    """(key at sorted position ``pos``, keys before it, keys equal to it) of the row's keys in K.

    Short rows introselect K in place (K and I permuted); longer ones pick the key from buckets
    of the top key bits (sort_quantile.emit_bucket_select: one histogram pass, the bucket
    holding ``pos`` gathered and introselected), leaving K in index order."""
    f, b = rk.f, rk.f.b
    zero = const(i64, 0)
    kv = f.var(rk.kt, const(rk.kt, 0), "kv")
    with f.if_else(b.icmp_signed("<=", rk.n, const(i64, SHORT_SELECT_ROW))) as (short, long_):
        with short:
            b.call(rk.algos().nth_element(), [K, I, zero, pos, rk.n])
            kv.set(f.load(rk.kt, K, pos))
        with long_:
            K2, I2, H = rk.scratch_arrays(["K2", "I2", "H"])
            state = f.array(i64, 2, "bucket_cache")
            bucket_starts(rk, K, H, state)
            kv.set(b.call(emit_bucket_select(rk), [K, K2, I2, H, rk.n, pos, state]))
    less = f.var(i64, zero, "less")
    same = f.var(i64, zero, "same")
    with f.for_range(zero, rk.n, name="count") as j:
        key = f.load(rk.kt, K, j)
        less.set(b.add(less.get(), b.zext(b.icmp_signed("<", key, kv.get()), i64)))
        same.set(b.add(same.get(), b.zext(b.icmp_signed("==", key, kv.get()), i64)))
    return kv.get(), less.get(), same.get()


def _nth_occurrence(rk: RowKernel, K, kv, skip):
    """Index of the ``skip``-th (0-based) element whose key is ``kv``, in index order: from K in
    index order, 16 keys a step with popcounts until the step that holds it; short rows (K
    introselected by ``_select``) from the row itself."""
    f, b = rk.f, rk.f.b
    L = 16
    zero, one = const(i64, 0), const(i64, 1)
    short = b.icmp_signed("<=", rk.n, const(i64, SHORT_SELECT_ROW))
    found = f.var(i64, zero, "found")
    with f.if_else(short) as (permuted, ordered):
        with permuted:  # K was permuted: scan the row in index order through the keys
            found.set(_first_match(rk, lambda k: b.icmp_signed("==", k, kv), skip))
        with ordered:
            seen = f.var(i64, zero, "seen")
            splat = b.insert_element(ir.Constant(vec(rk.kt, L), None), kv, const(i32, 0))
            splat = b.shuffle_vector(splat, splat, ir.Constant(vec(i32, L), [0] * L))
            full = b.and_(rk.n, const(i64, -L))
            start = f.var(i64, full, "start")
            mask_t = ir.IntType(L)
            with f.for_range(zero, full, step=L, name="occv") as j:
                bits = b.bitcast(b.icmp_signed("==", f.load_vec(rk.kt, L, K, j), splat), mask_t)
                cnt = b.zext(f.call_intrinsic(f"llvm.ctpop.i{L}", mask_t, [bits]), i64)
                with f.if_(b.icmp_signed(">", b.add(seen.get(), cnt), skip)):
                    start.set(j)
                    f.break_()
                seen.set(b.add(seen.get(), cnt))
            with f.for_range(start.get(), rk.n, name="occ") as j:
                with f.if_(b.icmp_signed("==", f.load(rk.kt, K, j), kv)):
                    with f.if_(b.icmp_signed("==", seen.get(), skip)):
                        found.set(j)
                        f.break_()
                    seen.set(b.add(seen.get(), one))
    return found.get()


def _first_match(rk: RowKernel, pred, skip):
    """Index of the ``skip``-th (0-based) element j, in index order, with pred(key(src[j]))."""
    f, b = rk.f, rk.f.b
    seen = f.var(i64, const(i64, 0), "seen")
    found = f.var(i64, const(i64, 0), "found")
    with f.for_range(const(i64, 0), rk.n, name="scan") as j:
        with f.if_(pred(rk.key(f.load(rk.vt, rk.src, j)))):
            with f.if_(b.icmp_signed("==", seen.get(), skip)):
                found.set(j)
                f.break_()
            seen.set(b.add(seen.get(), const(i64, 1)))
    return found.get()


NAN_SCAN_LANES = 16


def _first_nan(rk: RowKernel):
    """Index of the row's first NaN, ``n`` if it has none: 16 elements a step, stopping at the
    first step that holds one. ATen's median returns a row's first NaN without ordering the
    row, so with NaN present a full pass over the row (the keys' fill) made Kwker 25x slower
    than ATen; without NaN this costs a small fraction of the fill it precedes."""
    f, b, L = rk.f, rk.f.b, NAN_SCAN_LANES
    mask_t = ir.IntType(L)
    at = f.var(i64, rk.n, "nan_at")
    full = b.and_(rk.n, const(i64, -L))
    with f.for_range(const(i64, 0), full, step=L, name="nanv") as j:
        v = rk.as_float(f.load_vec(rk.vt, L, rk.src, j))
        bits = b.bitcast(b.fcmp_unordered("uno", v, v), mask_t)
        with f.if_(b.icmp_unsigned("!=", bits, ir.Constant(mask_t, 0))):
            lane = f.call_intrinsic(f"llvm.cttz.i{L}", mask_t, [bits, const(i1, 0)])
            at.set(b.add(j, b.zext(lane, i64)))
            f.break_()
    with f.if_(b.icmp_signed("==", at.get(), rk.n)):
        with f.for_range(full, rk.n, name="nant") as j:
            v = rk.as_float(f.load(rk.vt, rk.src, j))
            with f.if_(b.fcmp_unordered("uno", v, v)):
                at.set(j)
                f.break_()
    return at.get()


def emit_median_dim(rk: RowKernel, nan_ignoring: bool):
    """§6.1 closed form: element (n-1)//2 (or the nanmedian rank) of the stable ascending sort."""
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    zero, one, two = const(i64, 0), const(i64, 1), const(i64, 2)
    if not nan_ignoring and rk.is_float:  # a row with NaN: its first one, the row unordered
        first_nan = _first_nan(rk)
        with f.if_(b.icmp_signed("<", first_nan, rk.n)):
            rk.write(zero, first_nan)
            f.ret()
    nnan = rk.fill_keys(K, I, count_nan=nan_ignoring)
    if nan_ignoring and rk.is_float:
        with f.if_(b.icmp_signed("==", nnan, rk.n)):  # all NaN: introselect decides the index
            b.call(rk.algos().nth_element(), [K, I, zero, zero, rk.n])
            rk.write(zero, b.sext(f.load(i32, I, zero), i64))
            f.ret()
        m = b.sdiv(b.sub(b.sub(rk.n, nnan), one), two)
    else:
        m = b.sdiv(b.sub(rk.n, one), two)
    # the median is the (m - less)-th occurrence of its key in index order
    kv, less, _ = _select(rk, K, I, m)
    rk.write(zero, _nth_occurrence(rk, K, kv, b.sub(m, less)))


def emit_median_all(rk: RowKernel, nan_ignoring: bool):
    """§6.2: introselect on the flattened copy; median() of data with NaN is the canonical NaN."""
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    zero, one, two = const(i64, 0), const(i64, 1), const(i64, 2)
    if not nan_ignoring and rk.is_float:
        with f.if_(b.icmp_signed("<", _first_nan(rk), rk.n)):
            canonical = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # float NaN narrowed
            nan = (const(i16, canonical[rk.spec.dtype]) if rk.spec.dtype in HALF_FLOATS
                   else ir.Constant(rk.vt, float("nan")))
            f.store(nan, rk.a["out_v"], zero)
            f.store(const(i64, -1), rk.a["out_i"], zero)
            f.ret()
    nnan = rk.fill_keys(K, I, count_nan=nan_ignoring)
    nth = b.sdiv(b.sub(b.sub(rk.n, nnan), one), two)
    b.call(rk.algos().nth_element(), [K, I, zero, nth, rk.n])
    rk.write(zero, b.sext(f.load(i32, I, nth), i64))


def emit_mode(rk: RowKernel):
    """§7: std::sort with ATen's plain ``<`` on raw values, then the run scan.

    Without NaN, plain ``<`` and the key order make every comparison agree (±0 tie under
    both), so such rows use the vectorised key sort; rows with NaN sort raw values.
    """
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    zero, one = const(i64, 0), const(i64, 1)
    nnan = rk.fill_keys(K, I, count_nan=True)
    sorted_as = f.var(i1, const(i1, 1), "keys")  # true: K holds keys, else raw values
    if not rk.is_float:
        b.call(rk.algos().std_sort(), [K, I, zero, rk.n])
    if rk.is_float:
        ft = f32 if rk.spec.dtype in HALF_FLOATS else rk.vt  # raw values, as floats
        raw = SortAlgos(rk.m, ft, lambda bb, x, y: bb.fcmp_ordered("<", x, y),
                        f"{rk.spec.symbol}.raw")
        with f.if_else(b.icmp_signed("==", nnan, zero)) as (keys, raws):
            with keys:
                b.call(rk.algos().std_sort(), [K, I, zero, rk.n])
            with raws:
                with f.for_range(zero, rk.n, name="fill_raw") as j:
                    f.store(rk.as_float(f.load(rk.vt, rk.src, j)), K, j)
                    f.store(b.trunc(j, i32), I, j)
                b.call(raw.std_sort(), [K, I, zero, rk.n])
                sorted_as.set(const(i1, 0))

    def differ(i, j):
        d = b.icmp_signed("!=", f.load(rk.kt, K, i), f.load(rk.kt, K, j))
        if rk.is_float:  # raw values: every NaN ends a run
            d = b.select(sorted_as.get(), d,
                         b.fcmp_unordered("!=", f.load(ft, K, i), f.load(ft, K, j)))
        return d
    freq, maxf, mode_i = (f.var(i64, zero, nm) for nm in ("freq", "maxf", "mode_i"))
    last = b.sub(rk.n, one)
    with f.for_range(zero, rk.n, name="run") as i:
        freq.set(b.add(freq.get(), one))
        nxt = b.select(b.icmp_signed("<", i, last), b.add(i, one), i)
        end = b.or_(b.icmp_signed("==", i, last), differ(i, nxt))
        with f.if_(end):
            with f.if_(b.icmp_signed(">", freq.get(), maxf.get())):
                maxf.set(freq.get())
                mode_i.set(b.sext(f.load(i32, I, i), i64))
            freq.set(zero)
    rk.write(zero, mode_i.get())
