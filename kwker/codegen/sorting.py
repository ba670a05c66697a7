"""Eager sorting-type kernels: one row kernel per op, generic over sizes.

Contract: for each row (a contiguous slice of ``n`` input elements, rows ``in_rs`` elements apart)
the kernel writes exactly what ATen 2.13 writes: values and int64 indices, ties included
(``shared/aten-sorting-spec.md`` §3-§8).

Keys: every op except ``mode`` works on order-preserving signed integer keys. Floats map
``-0.0 -> +0.0`` and every NaN to INT_MAX (so NaNs are equivalent and after +inf, as ATen's
NaN-aware comparators have it), then to two's-complement order; narrow integers widen to i32;
``descending`` complements the key, which turns ATen's DESC comparator (NaN first) into ascending
``<``. Output values are always re-read from the input through the index, so NaN payloads and the
sign of zero are the input's own. ``mode`` uses ATen's plain, not NaN-aware, ``<`` on raw values.

Layout: argument slots (after the common four of rows.py) are listed in ``SLOTS``; scratch per
thread holds the key and index arrays (and the radix sort's second buffers and histograms).
Fast-math: none, except the quantile interpolation's explicit FMA, which is ATen's own arithmetic.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import (
    DTYPES,
    HALF_FLOATS,
    Fn,
    const,
    f32,
    f64,
    i1,
    i16,
    i32,
    i64,
    intrinsic,
    new_module,
    ptr,
    vec,
    void,
)
from .rows import FIRST_OP_SLOT, emit_row_driver
from .sortalgo import SortAlgos, emit_radix_sort, radix_hist_bytes

SLOTS = {name: FIRST_OP_SLOT + i for i, name in enumerate(
    ("src", "in_rs", "n", "out_v", "out_v_rs", "out_v_es", "out_i", "out_i_rs", "out_i_es",
     "p0", "p1", "p2", "p3"))}
NARG = FIRST_OP_SLOT + len(SLOTS)
INTERPOLATIONS = ("linear", "lower", "higher", "midpoint", "nearest")
# bytes before and after each scratch array: stopper masks may read 64 keys past the end
PAD = 512


def key_type(dtype: str) -> ir.IntType:
    return i64 if dtype in ("float64", "int64") else i32


def hist_bytes(kt: ir.IntType) -> int:
    """Counters for the radix sort, or the quantile selection's bucket starts."""
    return max(radix_hist_bytes(kt), (SELECT_BUCKETS + 1) * 8)


def _align(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def scratch_layout(op: str, dtype: str, n: int, stable: bool = False) -> dict[str, int]:
    """Byte offsets of the per-thread scratch arrays, and the total under ``"size"``."""
    kb = key_type(dtype).width // 8
    sizes = [("K", n * kb), ("I", n * 4)]
    if stable or op in ("quantile", "nanquantile"):
        sizes += [("K2", n * kb), ("I2", n * 4), ("H", hist_bytes(key_type(dtype)))]
    out, pos = {}, 0
    for name, size in sizes:
        out[name] = pos + PAD
        pos += _align(size + 2 * PAD)
    out["size"] = pos
    return out


class RowKernel:
    """Shared pieces of one op's row function: arguments, keys, outputs."""

    def __init__(self, module: ir.Module, spec, target):
        self.m, self.spec = module, spec
        self.vt, self.is_float, self.signed = DTYPES[spec.dtype]
        self.kt = key_type(spec.dtype)
        self.f = f = Fn(module, f"{spec.symbol}.row", void, [ptr, i64, ptr],
                        ["args", "row", "scratch"])
        self.args, self.row, self.scratch = f.args
        b = f.b
        self.a = {name: (f.arg_ptr(self.args, s) if name in ("src", "out_v", "out_i")
                         else f.arg_i64(self.args, s)) for name, s in SLOTS.items()}
        self.n = self.a["n"]
        self.src = f.gep(self.a["src"], b.mul(self.row, self.a["in_rs"]), self.vt)
        lanes = max(target.vector_bits // self.kt.width, 4)
        self.lanes = min(lanes, 16)
        self._algos: dict[tuple, SortAlgos] = {}

    def lt(self, b, x, y):
        return b.icmp_signed("<", x, y)

    def algos(self, lanes: int | None = None, packed: bool = False) -> SortAlgos:
        """The exact algorithms on this op's keys (one set per module and variant)."""
        lanes = self.lanes if lanes is None else lanes
        if packed:
            lanes = max(lanes // 2, 4)  # i64 words per vector
        key = (lanes, packed)
        if key not in self._algos:
            self._algos[key] = SortAlgos(self.m, self.kt, self.lt,
                                         f"{self.spec.symbol}.algo{lanes}{'p' * packed}",
                                         vector_lanes=lanes, packed=packed)
        return self._algos[key]

    def fill_packed(self, P):
        """P[j] = (key(src[j]) << 32) | j: one word per element for 32-bit keys."""
        f, b = self.f, self.f.b
        with f.for_range(const(i64, 0), self.n, name="fillp") as j:
            k = b.shl(b.sext(self.key(f.load(self.vt, self.src, j)), i64), const(i64, 32))
            f.store(b.or_(k, j), P, j)

    def write_packed(self, P, count):
        """Values (gathered from the row: keys do not keep NaN payloads) and indices of the
        packed words; 16 at a time when both outputs are contiguous along the row."""
        f, b, a = self.f, self.f.b, self.a
        start = const(i64, 0)
        W = 16
        if self.lanes >= 8 and self.vt in (f32, i32) and not (
                self.spec.op == "topk" and self.spec.dtype == "bfloat16"):
            one = const(i64, 1)
            dense = b.and_(b.icmp_signed("==", a["out_v_es"], one),
                           b.icmp_signed("==", a["out_i_es"], one))
            full = b.select(dense, b.and_(count, const(i64, -W)), const(i64, 0))
            out_v = f.gep(a["out_v"], b.mul(self.row, a["out_v_rs"]), self.vt)
            out_i = f.gep(a["out_i"], b.mul(self.row, a["out_i_rs"]), i64)
            vt, it = vec(self.vt, W), vec(i64, W)
            gather = intrinsic(self.m, f"llvm.masked.gather.v{W}{'f32' if self.vt == f32 else 'i32'}"
                               f".v{W}p0", vt, [vec(ptr, W), i32, vec(i1, W), vt])
            with f.for_range(const(i64, 0), full, step=W, name="outv") as j:
                idx = b.and_(f.load_vec(i64, W, P, j), ir.Constant(it, [0xFFFFFFFF] * W))
                ptrs = b.gep(self.src, [idx], inbounds=True, source_etype=self.vt)
                ptrs.type = vec(ptr, W)  # llvmlite types a vector GEP as a scalar pointer
                v = b.call(gather, [ptrs, const(i32, 4), ir.Constant(vec(i1, W), [1] * W),
                                    ir.Constant(vt, None)])
                b.store(v, f.gep(out_v, j, self.vt), align=4)
                b.store(idx, f.gep(out_i, j, i64), align=8)
            start = full
        with f.for_range(start, count, name="outp") as j:
            self.write(j, b.and_(f.load(i64, P, j), const(i64, 0xFFFFFFFF)))

    def scratch_arrays(self, names):
        """Pointers to the scratch arrays: offsets computed at run time from n."""
        b, kb = self.f.b, self.kt.width // 8
        sizes = {"K": b.mul(self.n, const(i64, kb)), "I": b.mul(self.n, const(i64, 4)),
                 "P": b.mul(self.n, const(i64, 8))}
        pad = const(i64, PAD)
        if names == ["P"]:  # P spans the K and I regions of scratch_layout
            return [self.f.gep(self.scratch, pad, ir.IntType(8))]
        sizes["K2"], sizes["I2"] = sizes["K"], sizes["I"]
        sizes["H"] = const(i64, hist_bytes(self.kt))
        out, pos = {}, const(i64, 0)
        for name in ("K", "I", "K2", "I2", "H"):
            out[name] = self.f.gep(self.scratch, b.add(pos, pad), ir.IntType(8))
            size = b.add(sizes[name], const(i64, 2 * PAD + 63))
            pos = b.add(pos, b.and_(size, const(i64, ~63)))
            if name == names[-1]:
                break
        return [out[nm] for nm in names]

    # ------------------------------------------------------------------ keys
    def as_float(self, v):
        """A stored value as a float: float16/bfloat16 bits widen exactly to float32, which is
        how ATen compares them."""
        if self.spec.dtype not in HALF_FLOATS:
            return v
        b = self.f.b
        lanes = v.type.count if isinstance(v.type, ir.VectorType) else None
        if self.spec.dtype == "float16":
            return b.fpext(b.bitcast(v, vec(ir.HalfType(), lanes) if lanes else ir.HalfType()),
                           vec(f32, lanes) if lanes else f32)
        wide = b.zext(v, vec(i32, lanes) if lanes else i32)
        wide = b.shl(wide, ir.Constant(vec(i32, lanes), [16] * lanes) if lanes else const(i32, 16))
        return b.bitcast(wide, vec(f32, lanes) if lanes else f32)

    def key(self, v, descending=None):
        """Order-preserving signed integer key of a value (scalar or vector)."""
        b = self.f.b
        desc = self.spec.descending if descending is None else descending
        if self.is_float:
            v = self.as_float(v)
        vty = v.type
        lanes = vty.count if isinstance(vty, ir.VectorType) else None

        def c(ty, x):
            return ir.Constant(vec(ty, lanes), [x] * lanes) if lanes else const(ty, x)
        kt = self.kt
        if self.is_float:
            ity = vec(kt, lanes) if lanes else kt
            bits = b.bitcast(v, ity)
            zero = b.fcmp_ordered("==", v, c(vty.element if lanes else vty, 0.0))
            bits = b.select(zero, c(kt, 0), bits)
            maxpos = (1 << (kt.width - 1)) - 1
            k = b.xor(bits, b.and_(b.ashr(bits, c(kt, kt.width - 1)), c(kt, maxpos)))
            k = b.select(b.fcmp_unordered("uno", v, v), c(kt, maxpos), k)
        elif self.vt.width < kt.width:
            ity = vec(kt, lanes) if lanes else kt
            k = b.sext(v, ity) if self.signed else b.zext(v, ity)
        else:
            k = v
        if desc:
            k = b.xor(k, c(kt, -1))
        return k

    def nan_key(self):
        return const(self.kt, (1 << (self.kt.width - 1)) - 1)

    def fill_keys(self, K, I, count_nan=False):
        """K[j] = key(src[j]), I[j] = j; returns the NaN count when asked (floats)."""
        f, b = self.f, self.f.b
        nnan = f.var(i64, const(i64, 0), "nnan")
        with f.for_range(const(i64, 0), self.n, name="fill") as j:
            k = self.key(f.load(self.vt, self.src, j))
            f.store(k, K, j)
            f.store(b.trunc(j, i32), I, j)
            if count_nan and self.is_float:
                isn = b.icmp_signed("==", k, self.nan_key())
                nnan.set(b.add(nnan.get(), b.zext(isn, i64)))
        return nnan.get()

    # ------------------------------------------------------------------ outputs
    def write(self, j, idx):
        """Output slot ``j`` of this row gets src[idx] and idx."""
        f, b, a = self.f, self.f.b, self.a
        vpos = b.add(b.mul(self.row, a["out_v_rs"]), b.mul(j, a["out_v_es"]))
        v = f.load(self.vt, self.src, idx)
        if self.spec.op == "topk" and self.spec.dtype == "bfloat16":
            # ATen's bfloat16 topk round-trips values through float32, which makes NaNs canonical
            v = b.select(b.fcmp_unordered("uno", self.as_float(v), self.as_float(v)),
                         const(i16, 0x7FC0), v)
        f.store(v, a["out_v"], vpos)
        ipos = b.add(b.mul(self.row, a["out_i_rs"]), b.mul(j, a["out_i_es"]))
        f.store(idx, a["out_i"], ipos)

    def write_sorted(self, I, count):
        f, b = self.f, self.f.b
        with f.for_range(const(i64, 0), count, name="out") as j:
            self.write(j, b.sext(f.load(i32, I, j), i64))

    def finish(self):
        self.f.finish()
        return self.f.fn


# ---------------------------------------------------------------------------------- ops
def _emit_radix(rk: RowKernel):
    b = rk.f.b
    K, I, K2, I2, H = rk.scratch_arrays(["K", "I", "K2", "I2", "H"])
    rk.fill_keys(K, I)
    radix = emit_radix_sort(rk.m, rk.kt, f"{rk.spec.symbol}.radix")
    flipped = b.call(radix, [K, I, K2, I2, H, rk.n])
    rk.write_sorted(b.select(flipped, I2, I), rk.n)


def _emit_sort(rk: RowKernel):
    b = rk.f.b
    if rk.spec.stable:
        algos = rk.algos(packed=True) if rk.kt == i32 else None
        if algos is not None and algos.distinct_max:
            # a short row's packed words (key << 32 | index) are all different: one network
            # sorts them in the stable order, where the radix sort's histograms would dominate
            f = rk.f
            short = b.icmp_signed("<=", rk.n, const(i64, algos.distinct_max))
            with f.if_else(short) as (network, radix):
                with network:
                    P, = rk.scratch_arrays(["P"])
                    rk.fill_packed(P)
                    algos.network_sort(f, P, const(i64, 0), rk.n)
                    rk.write_packed(P, rk.n)
                with radix:
                    _emit_radix(rk)
        else:
            _emit_radix(rk)
    elif rk.kt == i32:
        P, = rk.scratch_arrays(["P"])
        rk.fill_packed(P)
        _std_sort_maybe_parallel(rk, rk.algos(packed=True), P, P)
        rk.write_packed(P, rk.n)
    else:
        K, I = rk.scratch_arrays(["K", "I"])
        rk.fill_keys(K, I)
        _std_sort_maybe_parallel(rk, rk.algos(), K, I)
        rk.write_sorted(I, rk.n)


SPLIT_LEVELS = 3  # at most this many partition levels before a long row's ranges go to threads


def task_slot(t: int) -> int:
    """Slot of task ``t`` (in split order) in the worker's list, dealt round-robin to threads.

    With fewer partition levels than SPLIT_LEVELS the real ranges sit at every 2**(unused
    levels)-th task; bit-reversed slots put them first, so they go to different threads."""
    return int(format(t, f"0{SPLIT_LEVELS}b")[::-1], 2)


def _std_sort_maybe_parallel(rk: RowKernel, algos: SortAlgos, K, I):
    """std::sort of the row; with ``p0`` > 1 threads, one long row is shared between threads.

    introsort_loop(first, last, depth) partitions, recurses on the right part and loops on the
    left one with the same decremented depth, which is exactly introsort_loop(first, cut,
    depth). So after SPLIT_LEVELS partitions done here in the same order, the ranges are
    independent calls that may run on any thread in any order (§2.1; exact-and-fast §5).
    """
    f, b = rk.f, rk.f.b
    zero, one = const(i64, 0), const(i64, 1)
    threads, levels = rk.a["p0"], rk.a["p1"]  # levels: ceil(log2(threads)), from the caller
    with f.if_else(b.icmp_signed("<=", threads, one)) as (serial, parallel):
        with serial:
            b.call(algos.std_sort(), [K, I, zero, rk.n])
        with parallel:
            ntask = 2 ** SPLIT_LEVELS
            ctx = f.array(i64, 2 + 3 * ntask, "tasks")  # K, I, then (first, last, depth)*
            f.store(K, ctx, zero)
            f.store(I, ctx, one)
            tasks = [(zero, rk.n, algos.depth_limit(f, rk.n))]
            for level in range(SPLIT_LEVELS):
                split = []
                for first, last, depth in tasks:
                    can = b.and_(b.icmp_signed(">", b.sub(last, first), const(i64, 16)),
                                 b.icmp_signed(">", depth, zero))
                    can = b.and_(can, b.icmp_signed(">", levels, const(i64, level)))
                    cut = f.var(i64, last, "cut")
                    with f.if_(can):
                        cut.set(b.call(algos.partition(), [K, I, first, last]))
                    d = b.select(can, b.sub(depth, one), depth)
                    # without a partition the left task keeps the whole range, the right none
                    split += [(first, cut.get(), d), (cut.get(), last, d)]
                tasks = split
            for t, (first, last, depth) in enumerate(tasks):
                slot = task_slot(t)
                for j, v in enumerate((first, last, depth)):
                    f.store(v, ctx, const(i64, 2 + 3 * slot + j))
            worker = _introsort_worker(rk, algos, ntask)
            gomp = intrinsic(rk.m, "GOMP_parallel", void, [ptr, ptr, i32, i32])
            b.call(gomp, [worker, ctx, b.trunc(threads, i32), const(i32, 0)])


def _introsort_worker(rk: RowKernel, algos: SortAlgos, ntask: int) -> ir.Function:
    tnum = intrinsic(rk.m, "omp_get_thread_num", i32, [])
    tcount = intrinsic(rk.m, "omp_get_num_threads", i32, [])
    w = Fn(rk.m, f"{algos.prefix}.worker", void, [ptr], ["ctx"])
    b = w.b
    ctx = w.args[0]
    K, I = w.arg_ptr(ctx, 0), w.arg_ptr(ctx, 1)
    tid = b.sext(b.call(tnum, []), i64)
    nt = b.sext(b.call(tcount, []), i64)
    with w.for_range(tid, const(i64, ntask), name="task") as t:
        # tasks of one thread: t = tid, tid + nt, ...; for_range steps by 1, so skip others
        with w.if_(b.icmp_signed("==", b.srem(b.sub(t, tid), nt), const(i64, 0))):
            base = b.add(const(i64, 2), b.mul(t, const(i64, 3)))
            first = w.load(i64, ctx, base)
            last = w.load(i64, ctx, b.add(base, const(i64, 1)))
            depth = w.load(i64, ctx, b.add(base, const(i64, 2)))
            with w.if_(b.icmp_signed("<", first, last)):
                b.call(algos.introsort_loop(), [K, I, first, last, depth])
    return w.finish()


def _emit_topk(rk: RowKernel):
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
            with f.while_(lambda: b.icmp_signed("<=", b.add(j.get(), const(i64, L)), rk.n)):
                keys = rk.key(f.load_vec(rk.vt, L, rk.src, j.get()))
                root = algos.key_at(f, K, zero)
                splat = b.insert_element(ir.Constant(vec(rk.kt, L), None), root, const(i32, 0))
                splat = b.shuffle_vector(splat, splat, ir.Constant(vec(i32, L), [0] * L))
                m = b.zext(b.bitcast(b.icmp_signed("<", keys, splat), ir.IntType(L)), i64)
                mask = f.var(i64, m, "mask")
                with f.while_(lambda: b.icmp_unsigned("!=", mask.get(), zero)):
                    t = f.call_intrinsic("llvm.cttz.i64", i64, [mask.get(), const(i1, 0)])
                    offer(b.add(j.get(), t))
                    mask.set(b.and_(mask.get(), b.sub(mask.get(), const(i64, 1))))
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


def _emit_kthvalue(rk: RowKernel):
    """§5. If the k-th key occurs once in the row, its value and index are fixed whatever the
    algorithm, so the vectorised introselect finds it; a tie at the k-th key needs ATen's own
    quickselect, step by step, on a fresh copy."""
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    rk.fill_keys(K, I)
    zero = const(i64, 0)
    k0 = rk.a["p0"]  # 0-based
    b.call(rk.algos().nth_element(), [K, I, zero, k0, rk.n])
    kv = f.load(rk.kt, K, k0)
    same = f.var(i64, zero, "same")
    with f.for_range(zero, rk.n, name="count") as j:
        same.set(b.add(same.get(), b.zext(b.icmp_signed("==", f.load(rk.kt, K, j), kv), i64)))
    with f.if_else(b.icmp_signed("==", same.get(), const(i64, 1))) as (unique, tied):
        with unique:
            rk.write(zero, b.sext(f.load(i32, I, k0), i64))
        with tied:
            rk.fill_keys(K, I)
            b.call(rk.algos().aten_quickselect(), [K, I, rk.n, k0])
            rk.write(zero, b.sext(f.load(i32, I, k0), i64))


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


def _emit_median_dim(rk: RowKernel, nan_ignoring: bool):
    """§6.1 closed form: element (n-1)//2 (or the nanmedian rank) of the stable ascending sort."""
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    nnan = rk.fill_keys(K, I, count_nan=True)
    zero, one, two = const(i64, 0), const(i64, 1), const(i64, 2)
    nan_key = rk.nan_key()
    if not nan_ignoring and rk.is_float:
        with f.if_(b.icmp_signed(">", nnan, zero)):
            first_nan = _first_match(rk, lambda k: b.icmp_signed("==", k, nan_key), zero)
            rk.write(zero, first_nan)
            f.ret()
    if nan_ignoring and rk.is_float:
        with f.if_(b.icmp_signed("==", nnan, rk.n)):  # all NaN: introselect decides the index
            b.call(rk.algos().nth_element(), [K, I, zero, zero, rk.n])
            rk.write(zero, b.sext(f.load(i32, I, zero), i64))
            f.ret()
        m = b.sdiv(b.sub(b.sub(rk.n, nnan), one), two)
    else:
        m = b.sdiv(b.sub(rk.n, one), two)
    b.call(rk.algos().nth_element(), [K, I, zero, m, rk.n])
    kv = f.load(rk.kt, K, m)
    less = f.var(i64, zero, "less")
    with f.for_range(zero, rk.n, name="count") as j:
        less.set(b.add(less.get(), b.zext(b.icmp_signed("<", f.load(rk.kt, K, j), kv), i64)))
    rk.write(zero, _first_match(rk, lambda k: b.icmp_signed("==", k, kv),
                                b.sub(m, less.get())))


def _emit_median_all(rk: RowKernel, nan_ignoring: bool):
    """§6.2: introselect on the flattened copy; median() of data with NaN is the canonical NaN."""
    f, b = rk.f, rk.f.b
    K, I = rk.scratch_arrays(["K", "I"])
    nnan = rk.fill_keys(K, I, count_nan=True)
    zero, one, two = const(i64, 0), const(i64, 1), const(i64, 2)
    if not nan_ignoring and rk.is_float:
        with f.if_(b.icmp_signed(">", nnan, zero)):
            canonical = {"float16": 0x7E00, "bfloat16": 0x7FC0}  # float NaN narrowed
            nan = (const(i16, canonical[rk.spec.dtype]) if rk.spec.dtype in HALF_FLOATS
                   else ir.Constant(rk.vt, float("nan")))
            f.store(nan, rk.a["out_v"], zero)
            f.store(const(i64, -1), rk.a["out_i"], zero)
            f.ret()
    nth = b.sdiv(b.sub(b.sub(rk.n, nnan), one), two)
    b.call(rk.algos().nth_element(), [K, I, zero, nth, rk.n])
    rk.write(zero, b.sext(f.load(i32, I, nth), i64))


def _emit_mode(rk: RowKernel):
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


SHORT_QUANTILE_ROW = 256


def _emit_quantile(rk: RowKernel, nan_ignoring: bool):
    """§8.2: sort the row, then ATen's rank and FMA interpolation arithmetic in the dtype.

    Tie order changes only the sign of a zero and which NaN (payload) is picked, so the stable
    radix sort serves every row except those holding both zeros, or NaNs of different bit
    patterns where a NaN is picked (quantile with any NaN; nanquantile of an all-NaN row): those
    take the exact std::sort emulation.
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
    state = f.array(i64, 2, "bucket_cache")  # (bucket gathered into K2, its size)
    with f.if_else(exact) as (slow, fast):
        with slow:
            b.call(rk.algos().std_sort(), [K, I, zero, rk.n])
        with fast:  # bucket starts by the top 11 key bits, for selection without a sort
            with f.for_range(0, SELECT_BUCKETS + 1, name="hz") as z:
                f.store(zero, H, z)
            with f.for_range(zero, rk.n, name="hist") as j:
                slot = b.add(_bucket(rk, f.load(ity, K, j)), one)
                f.store(b.add(f.load(i64, H, slot), one), H, slot)
            with f.for_range(1, SELECT_BUCKETS + 1, name="starts") as z:
                f.store(b.add(f.load(i64, H, z), f.load(i64, H, b.sub(z, one))), H, z)
            f.store(const(i64, -1), state, zero)
    select = _emit_bucket_select(rk)
    zero_bits = b.select(pz.get(), const(ity, 0), const(ity, -(1 << (ity.width - 1))))

    def S(pos):
        """The value at sorted position ``pos``: read through the exact sort's indices, or
        selected by key (keys map back to bits exactly; ±0 and NaN as the row holds them)."""
        out = f.var(T, ir.Constant(T, 0.0), "S")
        with f.if_else(exact) as (slow, fast):
            with slow:
                out.set(f.load(T, rk.src, b.sext(f.load(i32, I, pos), i64)))
            with fast:
                k = b.call(select, [K, K2, I2, H, rk.n, pos, state])
                maxpos = const(ity, (1 << (ity.width - 1)) - 1)
                bits = b.xor(k, b.and_(b.ashr(k, const(ity, ity.width - 1)), maxpos))
                bits = b.select(b.icmp_signed("==", k, const(ity, 0)), zero_bits, bits)
                bits = b.select(b.icmp_signed("==", k, rk.nan_key()), nan_lo.get(), bits)
                out.set(b.bitcast(bits, T))
        return out.get()
    n_t = b.sitofp(b.sub(rk.n, one), T)
    c_t = b.sitofp(b.sub(b.sub(rk.n, nnan.get()), one), T)
    has_nan = b.icmp_signed(">", nnan.get(), zero)
    tys = {f32: "f32", f64: "f64"}[T]
    with f.for_range(zero, nq, name="q") as qi:
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
        lo = b.fptosi(sel, i64)
        out = f.var(T, S(lo), "out")
        lerp = b.or_(b.icmp_signed("==", interp, const(i64, 0)),
                     b.icmp_signed("==", interp, const(i64, 3)))
        with f.if_(lerp):
            w = b.select(b.icmp_signed("==", interp, const(i64, 3)), ir.Constant(T, 0.5),
                         b.fsub(rank, b.sitofp(lo, T)))
            hi = b.fptosi(r_ceil, i64)
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


SELECT_BUCKETS = 2048  # quantile selection buckets: the top 11 bits of the unsigned key


def _bucket(rk: RowKernel, key):
    kt, b = rk.kt, rk.f.b
    d = b.lshr(b.xor(key, const(kt, 1 << (kt.width - 1))), const(kt, kt.width - 11))
    return b.zext(d, i64) if kt.width < 64 else d


def _emit_bucket_select(rk: RowKernel) -> ir.Function:
    """select(K, C, D, starts, n, pos, cache) -> the key at sorted position ``pos``.

    The bucket holding ``pos`` is gathered into C (once: consecutive positions of one bucket
    reuse it) and introselected there; any selection gives the same key.
    """
    outer = rk.f
    f = Fn(rk.m, f"{rk.spec.symbol}.select", rk.kt, [ptr, ptr, ptr, ptr, i64, i64, ptr],
           ["K", "C", "D", "starts", "n", "pos", "cache"])
    K, C, D, H, n, pos, cache = f.args
    b = f.b
    zero, one = const(i64, 0), const(i64, 1)
    lo, hi = f.var(i64, zero, "lo"), f.var(i64, const(i64, SELECT_BUCKETS), "hi")
    with f.while_(lambda: b.icmp_signed(">", b.sub(hi.get(), lo.get()), one)):
        mid = b.sdiv(b.add(lo.get(), hi.get()), const(i64, 2))
        with f.if_else(b.icmp_signed("<=", f.load(i64, H, mid), pos)) as (up, down):
            with up:
                lo.set(mid)
            with down:
                hi.set(mid)
    bucket = lo.get()
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


def emit(spec, target) -> ir.Module:
    module = new_module(spec.symbol)
    rk = RowKernel(module, spec, target)
    op = spec.op
    if op == "sort":
        _emit_sort(rk)
    elif op == "topk":
        _emit_topk(rk)
    elif op == "kthvalue":
        _emit_kthvalue(rk)
    elif op in ("median", "nanmedian"):
        _emit_median_dim(rk, op == "nanmedian")
    elif op in ("median_all", "nanmedian_all"):
        _emit_median_all(rk, op == "nanmedian_all")
    elif op == "mode":
        _emit_mode(rk)
    elif op in ("quantile", "nanquantile"):
        _emit_quantile(rk, op == "nanquantile")
    else:
        raise ValueError(f"unknown sorting op {op!r}")
    emit_row_driver(module, spec.symbol, rk.finish())
    return module


