"""Exact emulations of the sequential algorithms that decide ATen's tie order.

Contract: every routine reproduces, step by step, the libstdc++ / ATen algorithm named in
``shared/aten-sorting-spec.md`` (section numbers below), so its output permutation is identical to
torch's, ties included. Elements are structure-of-arrays: a key array ``K`` (keys compare with
``lt``) and an i32 index array ``I`` that always moves with its key (sort_base.py).

Where the output is provably the same, a faster equivalent replaces a step; each module says
which and why: sort_partition.py (block-wise Hoare scans), sort_small.py (sorting networks for
short and all-distinct ranges), sort_equal.py (all-equal ranges), sort_presorted.py (ranges
without ties, from a sorted copy), sort_radix.py (the stable sort). This module composes them
into ``SortAlgos`` and holds the drivers built from them: std::sort, nth_element and ATen's
quickselect.

Fast-math: none. Comparisons are exact integer (or ordered float, for ``mode``) compares.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i64, ptr, void
from .sort_base import EQUAL_MIN, NETWORK_MAX, THRESHOLD
from .sort_equal import EqualRangeAlgos
from .sort_heap import HeapAlgos
from .sort_partition import PartitionAlgos
from .sort_presorted import PresortedAlgos
from .sort_radix import emit_radix_sort, emit_radix_sort_packed, radix_digits, radix_hist_bytes
from .sort_small import SmallSortAlgos

__all__ = ["NETWORK_MAX", "THRESHOLD", "SortAlgos", "emit_radix_sort", "emit_radix_sort_packed",
           "radix_digits", "radix_hist_bytes"]


class SortAlgos(PartitionAlgos, HeapAlgos, SmallSortAlgos, EqualRangeAlgos, PresortedAlgos):
    """Emits the exact sorting building blocks for one key type and comparator into a module.

    ``lt(b, x, y)`` emits "x goes strictly before y". ``vector_lanes`` > 0 enables the block
    partition, which needs integer keys compared with signed ``<``.
    """

    # ---------------------------------------------------------------- std::sort, nth_element
    def introsort_loop(self) -> ir.Function:
        def body(f: Fn):
            K, I, first, last0, depth0 = f.args
            b = f.b
            last, depth = f.var(i64, last0, "last"), f.var(i64, depth0, "depth")
            with f.while_(lambda: b.icmp_signed(">", b.sub(last.get(), first),
                                                const(i64, THRESHOLD))):
                if self.presorted:  # short ranges: the distinct-keys network is as quick
                    big = b.icmp_signed(">", b.sub(last.get(), first),
                                        const(i64, max(self.distinct_max, THRESHOLD)))
                    S = self.sorted_copy(f, I)
                    with f.if_(b.and_(big, b.icmp_unsigned("!=", S, ir.Constant(ptr, None)))):
                        with f.if_(b.call(self.presorted_copy(), [K, S, first, last.get()])):
                            f.ret()
                if self.equal_ranges:
                    big = b.icmp_signed(">=", b.sub(last.get(), first), const(i64, EQUAL_MIN))
                    with f.if_(big):
                        done = b.call(self.equal_subtree(), [K, I, first, last.get(),
                                                             depth.get()])
                        with f.if_(done):
                            f.ret()
                if self.distinct_max:
                    small = b.icmp_signed("<=", b.sub(last.get(), first),
                                          const(i64, self.distinct_max))
                    with f.if_(small):
                        done = b.call(self.distinct_sort(), [K, I, first, last.get()])
                        with f.if_(done):
                            f.ret()
                with f.if_(b.icmp_signed("==", depth.get(), const(i64, 0)), likely=False):
                    b.call(self.heap_select(), [K, I, first, last.get(), last.get()])
                    b.call(self.sort_heap(), [K, I, first, last.get()])
                    f.ret()
                depth.set(b.sub(depth.get(), const(i64, 1)))
                cut = b.call(self.partition(), [K, I, first, last.get()])
                b.call(f.fn, [K, I, cut, last.get(), depth.get()])
                last.set(cut)
            if self.lanes:
                b.call(self.small_stable_sort(), [K, I, first, last.get()])
        return self._fn("introsort_loop", void, [ptr, ptr, i64, i64, i64],
                        ["K", "I", "first", "last", "depth"], body)

    def depth_limit(self, f: Fn, n):
        lg = f.b.sub(const(i64, 63), f.call_intrinsic("llvm.ctlz.i64", i64, [n, const(i1, 0)]))
        return f.b.mul(lg, const(i64, 2))

    def std_sort(self) -> ir.Function:
        """std::sort(first, last) exactly (§2.1)."""
        def body(f: Fn):
            K, I, first, last = f.args
            b = f.b
            with f.if_(b.icmp_signed(">=", first, last)):
                f.ret()
            depth = self.depth_limit(f, b.sub(last, first))
            b.call(self.introsort_loop(), [K, I, first, last, depth])
            if not self.lanes:  # else each leftover segment was already sorted in place
                self.final_insertion_sort(f, K, I, first, last)
        return self._fn("std_sort", void, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)

    def nth_element(self) -> ir.Function:
        """std::nth_element(first, nth, last) exactly (§2.4)."""
        def body(f: Fn):
            K, I, first0, nth, last0 = f.args
            b = f.b
            with f.if_(b.or_(b.icmp_signed("==", first0, last0),
                             b.icmp_signed("==", nth, last0))):
                f.ret()
            first, last = f.var(i64, first0, "first"), f.var(i64, last0, "last")
            depth = f.var(i64, self.depth_limit(f, b.sub(last0, first0)), "depth")
            with f.while_(lambda: b.icmp_signed(">", b.sub(last.get(), first.get()),
                                                const(i64, 3))):
                with f.if_(b.icmp_signed("==", depth.get(), const(i64, 0)), likely=False):
                    b.call(self.heap_select(), [K, I, first.get(), b.add(nth, const(i64, 1)),
                                                last.get()])
                    self.swap(f, K, I, first.get(), nth)
                    f.ret()
                depth.set(b.sub(depth.get(), const(i64, 1)))
                cut = b.call(self.partition(), [K, I, first.get(), last.get()])
                with f.if_else(b.icmp_signed("<=", cut, nth)) as (right, left):
                    with right:
                        first.set(cut)
                    with left:
                        last.set(cut)
            b.call(self.guarded_insertion_sort(), [K, I, first.get(), last.get()])
        return self._fn("nth_element", void, [ptr, ptr, i64, i64, i64],
                        ["K", "I", "first", "nth", "last"], body)

    # ---------------------------------------------------------------- §2.6 ATen quickselect
    def aten_quickselect(self) -> ir.Function:
        """ATen's quick_select_template(A, k) over [0, n) (kthvalue), with gt(x, y) = lt(y, x)."""
        def body(f: Fn):
            K, I, n, k = f.args
            b = f.b
            one = const(i64, 1)

            def gt(x, y):
                return self.lt(b, y, x)

            def key(i):
                return self.key_at(f, K, i)

            def cswap(x, y):
                with f.if_(gt(key(x), key(y))):
                    self.swap(f, K, I, x, y)
            L, R = f.var(i64, const(i64, 0), "L"), f.var(i64, b.sub(n, one), "R")
            with f.loop():
                with f.if_(b.icmp_signed("<=", R.get(), L.get())):
                    f.ret()
                with f.if_(b.icmp_signed("==", R.get(), b.add(L.get(), one))):
                    cswap(L.get(), R.get())
                    f.ret()
                lo, hi = L.get(), R.get()
                p = b.add(lo, b.sdiv(b.sub(hi, lo), const(i64, 2)))
                lo1 = b.add(lo, one)
                self.swap(f, K, I, p, lo1)
                cswap(lo1, hi)
                cswap(lo, hi)
                cswap(lo1, lo)
                i, j = f.var(i64, lo1, "i"), f.var(i64, hi, "j")
                piv = key(lo)
                with f.loop():
                    i.set(b.add(i.get(), one))
                    with f.while_(lambda: gt(piv, key(i.get()))):
                        i.set(b.add(i.get(), one))
                    j.set(b.sub(j.get(), one))
                    with f.while_(lambda: gt(key(j.get()), piv)):
                        j.set(b.sub(j.get(), one))
                    with f.if_(b.icmp_signed("<", j.get(), i.get())):
                        f.break_()
                    self.swap(f, K, I, i.get(), j.get())
                self.swap(f, K, I, lo, j.get())
                with f.if_(b.icmp_signed("<=", j.get(), k)):
                    L.set(i.get())
                with f.if_(b.icmp_signed(">=", j.get(), k)):
                    R.set(b.sub(j.get(), one))
        return self._fn("quickselect", void, [ptr, ptr, i64, i64], ["K", "I", "n", "k"], body)
