"""sort: the whole row in ATen's order (§3).

Stable sorts run the LSD radix sort (a short row of 32-bit keys: one sorting network); the others
std::sort exactly: 32-bit keys on packed (key << 32 | index) words, introsort only where keys
tie and a radix-sorted copy elsewhere (sort_presorted.py); several threads share one long row
when the caller asks for them. Operands p0, p1: threads and partition levels of a shared row;
p2: the presort switch; p3: the row length from which the radix sort of 32-bit keys takes byte
digits (0: never; sort_radix.py). The caller measures p2 and p3 per CPU (ops/thresholds.py).
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, intrinsic, ptr, vec, void
from .sort_presorted import TIED, presorted_context
from .sort_rows import RowKernel
from .sortalgo import SortAlgos, emit_radix_sort, emit_radix_sort_packed


def _emit_radix(rk: RowKernel):
    b = rk.f.b
    if rk.kt == i32:  # packed words: one store per element and pass instead of two
        P, = rk.scratch_arrays(["P"])
        H, W = rk.scratch_arrays(["H", "W"])
        varying = rk.fill_packed(P)
        radix = emit_radix_sort_packed(rk.m, f"{rk.spec.symbol}.radix")
        rk.write_packed(b.call(radix, [P, P, W, H, rk.n, varying, rk.a["p3"]]), rk.n)
        return
    K, I, K2, I2, H = rk.scratch_arrays(["K", "I", "K2", "I2", "H"])
    varying = rk.fill_keys(K, I, varying=True)
    radix = emit_radix_sort(rk.m, rk.kt, f"{rk.spec.symbol}.radix")
    flipped = b.call(radix, [K, I, K2, I2, H, rk.n, varying])
    rk.write_sorted(b.select(flipped, I2, I), rk.n, b.select(flipped, K2, K))


def emit_sort(rk: RowKernel):
    b = rk.f.b
    if rk.spec.stable:
        algos = rk.algos(packed=True) if rk.kt == i32 else None
        if algos is not None and algos.network_max:
            # a short row's packed words (key << 32 | index) are all different: one network
            # sorts them in the stable order, where the radix sort's histograms would dominate
            f = rk.f
            short = b.icmp_signed("<=", rk.n, const(i64, algos.network_max))
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
        _emit_presorted(rk)
    else:
        K, I = rk.scratch_arrays(["K", "I"])
        rk.fill_keys(K, I)
        _std_sort_maybe_parallel(rk, rk.algos(), K, I)
        rk.write_sorted(I, rk.n, K)


# a row with more tied pairs than one per this many elements is partitioned exactly throughout
# (flagged ranges reach nearly every level), so its radix sort would be wasted time
TIES_PER_ROW = 1024
SAMPLE = 32  # keys sampled across a row to spot tie-heavy data before the radix sort
# shorter rows run introsort throughout: the radix sort's 6144 counters cost more than it saves
PRESORT_MIN_ROW = 512


def _emit_presorted(rk: RowKernel):
    """std::sort of 32-bit keys, from a radix-sorted copy where keys do not tie
    (sort_presorted.py): a row without ties is its radix sort; with a few, the packed words of
    tied keys are flagged and introsort copies every range without a flag from the sorted words.
    Short rows, rows with many ties (a tie among a few sampled keys, or more than one tied pair
    per TIES_PER_ROW elements), a long row shared between threads, and every row when the
    caller's switch (p2, measured per CPU by ops.thresholds) is 0 run introsort throughout."""
    f, b = rk.f, rk.f.b
    zero, one = const(i64, 0), const(i64, 1)
    P, = rk.scratch_arrays(["P"])
    H, W, S = rk.scratch_arrays(["H", "W", "S"])
    algos = rk.algos(packed=True, presorted=True)
    varying = rk.fill_packed(W)
    sorted_words = f.var(ptr, ir.Constant(ptr, None), "sorted")  # null: introsort throughout
    serial = b.and_(b.icmp_signed("<=", rk.a["p0"], one),
                    b.icmp_signed(">=", rk.n, const(i64, PRESORT_MIN_ROW)))
    serial = b.and_(serial, b.icmp_signed("!=", rk.a["p2"], zero))  # the caller's switch
    distinct = f.var(i1, const(i1, 0), "distinct")
    with f.if_(serial):
        distinct.set(b.not_(_sample_has_tie(rk)))
    with f.if_(distinct.get()):
        radix = emit_radix_sort_packed(rk.m, f"{rk.spec.symbol}.radix")
        R = b.call(radix, [W, P, S, H, rk.n, varying, rk.a["p3"]])
        last = b.sub(rk.n, one)
        high = const(i64, -(1 << 32))

        def tied(j):  # sorted words j and j + 1 share their key
            return b.icmp_unsigned("==", b.and_(f.load(i64, R, j), high),
                                   b.and_(f.load(i64, R, b.add(j, one)), high))
        ties = f.var(i64, zero, "ties")
        with f.for_range(zero, last, name="ties") as j:
            ties.set(b.add(ties.get(), b.zext(tied(j), i64)))
        with f.if_(b.icmp_signed("==", ties.get(), zero)):
            rk.write_packed(R, rk.n)
            f.ret()
        few = b.icmp_signed("<=", b.mul(ties.get(), const(i64, TIES_PER_ROW)), rk.n)
        with f.if_(few):
            flag, index = const(i64, TIED), const(i64, TIED - 1)
            with f.for_range(zero, last, name="flag") as j:
                with f.if_(tied(j)):
                    for at in (j, b.add(j, one)):
                        idx = b.and_(f.load(i64, R, at), index)
                        f.store(b.or_(f.load(i64, W, idx), flag), W, idx)
            sorted_words.set(R)
    # the radix sort's other buffer (or S, unused without it) is the context's spare array
    spare = b.select(b.icmp_unsigned("==", sorted_words.get(), S), P, S)
    _std_sort_maybe_parallel(rk, algos, W, presorted_context(f, sorted_words.get(), spare))
    rk.write_packed(W, rk.n)


def _sample_has_tie(rk: RowKernel) -> ir.Value:
    """Whether SAMPLE keys spread over the row hold two equal ones: tie-heavy data (a few
    distinct values) shows it at once, a row of random floats almost never."""
    f, b = rk.f, rk.f.b
    step = b.sdiv(rk.n, const(i64, SAMPLE))
    lanes = [b.mul(const(i64, t), step) for t in range(SAMPLE)]
    keys = [rk.key(f.load(rk.vt, rk.src, at)) for at in lanes]
    vt = vec(rk.kt, SAMPLE)
    v = ir.Constant(vt, None)
    for t, k in enumerate(keys):
        v = b.insert_element(v, k, const(i32, t))
    found = const(i1, 0)
    for shift in range(1, SAMPLE):  # every pair once: lane t against lane t + shift
        rot = b.shuffle_vector(v, v, ir.Constant(vec(i32, SAMPLE),
                                                 [(t + shift) % SAMPLE for t in range(SAMPLE)]))
        eq = b.bitcast(b.icmp_signed("==", v, rot), ir.IntType(SAMPLE))
        found = b.or_(found, b.icmp_unsigned("!=", eq, const(ir.IntType(SAMPLE), 0)))
    # n < SAMPLE: step 0 samples the first key SAMPLE times, which is no tie
    return b.and_(found, b.icmp_signed(">", step, const(i64, 0)))


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
