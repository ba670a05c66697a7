"""Exact emulations of the sequential algorithms that decide ATen's tie order.

Contract: every routine reproduces, step by step, the libstdc++ / ATen algorithm named in
``shared/aten-sorting-spec.md`` (section numbers below), so its output permutation is identical to
torch's, ties included. Elements are structure-of-arrays: a key array ``K`` (keys compare with
``lt``) and an i32 index array ``I`` that always moves with its key.

Where the output is provably the same, a faster equivalent replaces a step:
* the Hoare partition runs 64 positions at a time (vector compares -> stopper bitmasks -> pair the
  k-th left stopper with the k-th right stopper, BlockQuicksort-style). Hoare's scans are a pairing
  of original stoppers until the scans cross, so the swaps are the same; near the crossing the
  scalar loop takes over from the exact Hoare state (lo, hi);
* the stable sort is an LSD radix sort (any stable sort gives the one stable order);
* packed (key << 32 | index) words: each leftover segment of <= 16 elements is stably sorted by
  a sorting network; a range of <= 64 whose keys all differ has one sorted order, so a network
  sorts it whatever introsort would do; a range whose keys are all equal has partitions fixed by
  its length alone, so its whole subtree is swaps and vector reversals (``equal_subtree``).

Fast-math: none. Comparisons are exact integer (or ordered float, for ``mode``) compares.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, intrinsic, ptr, vec, void

THRESHOLD = 16  # libstdc++ _S_threshold
BLOCKS = (64, 16)  # block partition widths: wide while the scans are far apart, then narrow
EQUAL_MIN = 64  # ranges at least this long are checked for all-equal keys (one-pass subtree)
# packed ranges up to this long try a sorting network first (64 beat 32 on AVX-512 and on AVX2
# code, measured on a Zen 4)
NETWORK_MAX = 64


class SortAlgos:
    """Emits the exact sorting building blocks for one key type and comparator into a module.

    ``lt(b, x, y)`` emits "x goes strictly before y". ``vector_lanes`` > 0 enables the block
    partition, which needs integer keys compared with signed ``<``.
    """

    def __init__(self, module: ir.Module, key_type: ir.Type, lt, prefix: str,
                 vector_lanes: int = 0, packed: bool = False):
        self.m, self.kt, self.lt, self.prefix = module, key_type, lt, prefix
        self.lanes = vector_lanes
        # packed: one i64 word per element, (i32 key << 32) | index, in K (I unused): a swap is
        # two loads and two stores instead of four and four
        self.packed = packed
        assert not packed or key_type == i32
        self.elem_types = [i64] if packed else [key_type, i32]
        # packed words: all-equal ranges of EQUAL_MIN or more take their whole subtree at once
        self.equal_ranges = packed and vector_lanes >= 4
        self.distinct_max = NETWORK_MAX if packed and vector_lanes >= 4 else 0
        self._fns: dict[str, ir.Function] = {}

    # ---------------------------------------------------------------- element helpers
    def _get(self, f: Fn, K, I, i):
        if self.packed:
            return (f.load(i64, K, i),)
        return f.load(self.kt, K, i), f.load(i32, I, i)

    def _put(self, f: Fn, K, I, i, elem):
        if self.packed:
            f.store(elem[0], K, i)
            return
        f.store(elem[0], K, i)
        f.store(elem[1], I, i)

    def key_of(self, b, elem):
        return b.trunc(b.ashr(elem[0], const(i64, 32)), i32) if self.packed else elem[0]

    def key_at(self, f: Fn, K, i):
        return self.key_of(f.b, self._get(f, K, None, i)) if self.packed else \
            f.load(self.kt, K, i)

    def _move(self, f: Fn, K, I, dst, src):
        self._put(f, K, I, dst, self._get(f, K, I, src))

    def swap(self, f: Fn, K, I, a, b):
        ea, eb = self._get(f, K, I, a), self._get(f, K, I, b)
        self._put(f, K, I, a, eb)
        self._put(f, K, I, b, ea)

    def _fn(self, name: str, ret, args, argnames, body):
        full = f"{self.prefix}.{name}"
        if full not in self._fns:
            f = Fn(self.m, full, ret, args, argnames)
            self._fns[full] = f.fn
            body(f)
            f.finish()
        return self._fns[full]

    # ---------------------------------------------------------------- §2.1 introsort parts
    def median_of_three_to(self, f: Fn, K, I, dest, a, b, c):
        b_ = f.b
        ka, kb, kc = (self.key_at(f, K, x) for x in (a, b, c))
        ab, bc, ac = self.lt(b_, ka, kb), self.lt(b_, kb, kc), self.lt(b_, ka, kc)
        m_true = b_.select(bc, b, b_.select(ac, c, a))
        m_false = b_.select(ac, a, b_.select(bc, c, b))
        self.swap(f, K, I, dest, b_.select(ab, m_true, m_false))

    def hoare(self) -> ir.Function:
        """hoare_unguarded(K, I, lo, hi, pivot_pos) -> cut, from any exact Hoare state."""
        def body(f: Fn):
            K, I, lo0, hi0, pp = f.args
            b = f.b
            lo, hi = f.var(i64, lo0, "lo"), f.var(i64, hi0, "hi")
            pv = self.key_at(f, K, pp)
            with f.loop():
                with f.while_(lambda: self.lt(b, self.key_at(f, K, lo.get()), pv)):
                    lo.set(b.add(lo.get(), const(i64, 1)))
                hi.set(b.sub(hi.get(), const(i64, 1)))
                with f.while_(lambda: self.lt(b, pv, self.key_at(f, K, hi.get()))):
                    hi.set(b.sub(hi.get(), const(i64, 1)))
                with f.if_(b.icmp_signed(">=", lo.get(), hi.get())):
                    f.ret(lo.get())
                self.swap(f, K, I, lo.get(), hi.get())
                lo.set(b.add(lo.get(), const(i64, 1)))
        return self._fn("hoare", i64, [ptr, ptr, i64, i64, i64], ["K", "I", "lo", "hi", "pp"],
                        body)

    def hoare_small(self) -> ir.Function:
        """hoare_unguarded(lo, hi) for hi - lo < 32, from two stopper masks taken up front.

        Swaps only touch positions that neither scan visits again, so the masks of the
        untouched range stay valid, and libstdc++'s unguarded scans reduce to bit scans: the
        left scan stops at the first left stopper in [lo, hi), else at hi (which holds a
        swapped-in left stopper, or is beyond the median-of-three guard); the right scan at the
        last right stopper in [lo, hi), else at lo - 1 (the pivot or a swapped-in right stopper).
        No mispredicted branch per element, and no wide load right after a narrow store. The
        masks read 32 keys from lo: the key arrays carry that much padding. The narrowest block
        rounds stop below 2 * BLOCKS[-1] = 32 positions, which is what makes 32 enough.
        """
        assert 2 * BLOCKS[-1] <= 32
        def body(f: Fn):
            K, I, lo0, hi0, pp = f.args
            b = f.b
            zero, one = const(i64, 0), const(i64, 1)
            pv = self.key_at(f, K, pp)
            # Stoppers in [lo0, hi0) only. Iteration k pairs the k-th left stopper l_k (from
            # the left) with the k-th right stopper r_k (from the right) and swaps them while
            # l_k < r_k; the left scan then stops at min(l_{p+1}, r_p) (r_0 = hi0). Each mask
            # only loses its lowest bit per swap: a one-cycle dependency between iterations.
            live = b.sub(b.shl(one, b.sub(hi0, lo0)), one)
            left_m = b.and_(self._stopper_mask(f, K, lo0, pv, ">=", 32), live)
            right_m = b.and_(self._stopper_mask(f, K, lo0, pv, "<=", 32), live)
            lm = f.var(i64, left_m, "lm")
            rm = f.var(i64, f.call_intrinsic("llvm.bitreverse.i64", i64, [right_m]), "rm")
            prev_r = f.var(i64, hi0, "prev_r")
            top = b.add(lo0, const(i64, 63))
            with f.loop():
                false = const(i1, 0)
                left = b.select(b.icmp_unsigned("==", lm.get(), zero), hi0, b.add(
                    lo0, f.call_intrinsic("llvm.cttz.i64", i64, [lm.get(), false])))
                right = b.select(b.icmp_unsigned("==", rm.get(), zero), lo0, b.sub(
                    top, f.call_intrinsic("llvm.cttz.i64", i64, [rm.get(), false])))
                with f.if_(b.icmp_signed(">=", left, right)):
                    f.ret(b.select(b.icmp_signed("<", left, prev_r.get()), left, prev_r.get()))
                self.swap(f, K, I, left, right)
                prev_r.set(right)
                lm.set(b.and_(lm.get(), b.sub(lm.get(), one)))
                rm.set(b.and_(rm.get(), b.sub(rm.get(), one)))
        return self._fn("hoare_small", i64, [ptr, ptr, i64, i64, i64],
                        ["K", "I", "lo", "hi", "pp"], body)

    def _stopper_mask(self, f: Fn, K, base, pv, pred: str, width: int) -> ir.Value:
        """i64 bitmask over K[base:base+width]: bit t set iff ``K[base+t] pred pv``."""
        b = f.b
        lane_t = self.kt
        if self.packed:  # compare whole words: key >= p <=> w >= p<<32; key <= p <=> w <= p<<32|~0
            lane_t = i64
            pv = b.shl(b.sext(pv, i64), const(i64, 32))
            if pred == "<=":
                pv = b.or_(pv, const(i64, 0xFFFFFFFF))
        # One wide compare: LLVM splits it into register-sized compares and joins their mask
        # registers directly (kunpck), cheaper than shifting and or-ing partial masks.
        W = width
        splat = b.insert_element(ir.Constant(vec(lane_t, W), None), pv, const(i32, 0))
        splat = b.shuffle_vector(splat, splat, ir.Constant(vec(i32, W), [0] * W))
        v = f.load_vec(lane_t, W, K, base)
        bits = b.bitcast(b.icmp_signed(pred, v, splat), ir.IntType(W))
        return bits if W == 64 else b.zext(bits, i64)

    def partition(self) -> ir.Function:
        """partition_with_pivot(K, I, first, last) -> cut: median of three, then Hoare."""
        def body(f: Fn):
            K, I, first, last = f.args
            b = f.b
            one = const(i64, 1)
            mid = b.add(first, b.sdiv(b.sub(last, first), const(i64, 2)))
            self.median_of_three_to(f, K, I, first, b.add(first, one), mid, b.sub(last, one))
            lo, hi = f.var(i64, b.add(first, one), "lo"), f.var(i64, last, "hi")
            finish = self.hoare()
            if self.lanes:
                # small ranges: the Hoare tail reverses an all-equal range just as fast
                with f.if_(b.icmp_signed(">=", b.sub(last, first), const(i64, EQUAL_MIN))):
                    self._all_equal_shortcut(f, K, I, first, last)
                for width in BLOCKS:
                    with f.while_(lambda: b.icmp_signed(">=", b.sub(hi.get(), lo.get()),
                                                        const(i64, 2 * width))):
                        self._block_pairs(f, K, I, first, lo, hi, width)
                finish = self.hoare_small()
            f.ret(b.call(finish, [K, I, lo.get(), hi.get(), first]))
        return self._fn("partition", i64, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)

    def _all_equal_shortcut(self, f: Fn, K, I, first, last):
        """A range whose keys all equal the pivot: every element stops both scans, so Hoare
        swaps (first+1, last-1), (first+2, last-2), ... -- it reverses [first+1, last) -- and
        returns first + 1 + (last-first-1)//2. Tie-heavy rows spend most of their time in such
        ranges; the check leaves at the first differing block otherwise."""
        b = f.b
        one, zero = const(i64, 1), const(i64, 0)
        pv = self.key_at(f, K, first)
        pos = f.var(i64, f.b.add(first, one), "eqpos")  # K[first] is the pivot itself
        W = 16
        with f.while_(lambda: b.icmp_signed("<=", b.add(pos.get(), const(i64, W)), last)):
            lt = self._stopper_mask(f, K, pos.get(), pv, ">=", W)  # not below the pivot
            gt = self._stopper_mask(f, K, pos.get(), pv, "<=", W)  # not above the pivot
            full = const(i64, (1 << W) - 1)
            with f.if_(b.icmp_unsigned("!=", b.and_(lt, gt), full)):
                f.break_()
            pos.set(b.add(pos.get(), const(i64, W)))
        with f.if_(b.icmp_signed(">", b.add(pos.get(), const(i64, W)), last)):
            # the vector blocks were all equal; check the tail one by one
            tail_ok = f.var(ir.IntType(1), const(ir.IntType(1), 1), "tail_ok")
            with f.for_range(pos.get(), last, name="eqtail") as j:
                with f.if_(b.icmp_signed("!=", self.key_at(f, K, j), pv)):
                    tail_ok.set(const(ir.IntType(1), 0))
                    f.break_()
            with f.if_(tail_ok.get()):
                n_rev = b.sdiv(b.sub(b.sub(last, first), one), const(i64, 2))
                if self.packed:
                    self._reverse(f, K, b.add(first, one), last, n_rev)
                else:
                    with f.for_range(zero, n_rev, name="rev") as i:
                        self.swap(f, K, I, b.add(b.add(first, one), i),
                                  b.sub(b.sub(last, one), i))
                f.ret(b.add(b.add(first, one), n_rev))

    def _block_pairs(self, f: Fn, K, I, first, lo, hi, width: int):
        """Advance the exact Hoare state (lo, hi) ``width`` positions at a time.

        Left and right blocks are only loaded while they are disjoint, so every pair found
        lies strictly left-before-right and is a real Hoare swap; when no disjoint block is
        left, the caller continues from (lo, hi), which is a valid Hoare state at any time.
        """
        b = f.b
        cw, zero, one = const(i64, width), const(i64, 0), const(i64, 1)
        pv = self.key_at(f, K, first)
        lf, rf = f.var(i64, lo.get(), "lf"), f.var(i64, hi.get(), "rf")  # scanned frontiers
        lb, rb = f.var(i64, zero, "lb"), f.var(i64, zero, "rb")
        lm, rm = f.var(i64, zero, "lm"), f.var(i64, zero, "rm")
        with f.loop():
            with f.if_(b.icmp_unsigned("==", lm.get(), zero)):
                with f.if_(b.icmp_signed("<", b.sub(rf.get(), lf.get()), cw)):
                    f.break_()
                lb.set(lf.get())
                lm.set(self._stopper_mask(f, K, lf.get(), pv, ">=", width))  # not lt(x, p)
                lf.set(b.add(lf.get(), cw))
            with f.if_(b.icmp_unsigned("==", rm.get(), zero)):
                with f.if_(b.icmp_signed("<", b.sub(rf.get(), lf.get()), cw)):
                    f.break_()
                rb.set(b.sub(rf.get(), cw))
                m = self._stopper_mask(f, K, rb.get(), pv, "<=", width)  # not lt(p, x)
                m = f.call_intrinsic("llvm.bitreverse.i64", i64, [m])
                rm.set(b.lshr(m, const(i64, 64 - width)) if width < 64 else m)
                rf.set(rb.get())
            with f.while_(lambda: b.and_(b.icmp_unsigned("!=", lm.get(), zero),
                                         b.icmp_unsigned("!=", rm.get(), zero))):
                false = const(i1, 0)
                tl = f.call_intrinsic("llvm.cttz.i64", i64, [lm.get(), false])
                tr = f.call_intrinsic("llvm.cttz.i64", i64, [rm.get(), false])
                left = b.add(lb.get(), tl)
                right = b.sub(b.add(rb.get(), const(i64, width - 1)), tr)
                self.swap(f, K, I, left, right)
                lo.set(b.add(left, one))
                hi.set(right)
                lm.set(b.and_(lm.get(), b.sub(lm.get(), one)))
                rm.set(b.and_(rm.get(), b.sub(rm.get(), one)))
        # A side whose mask is used up scanned only non-stoppers since its last swap, and its
        # next scan would pass over them: start it at its frontier (still an exact state).
        with f.if_(b.icmp_unsigned("==", lm.get(), zero)):
            lo.set(b.select(b.icmp_signed(">", lf.get(), lo.get()), lf.get(), lo.get()))
        with f.if_(b.icmp_unsigned("==", rm.get(), zero)):
            hi.set(b.select(b.icmp_signed("<", rf.get(), hi.get()), rf.get(), hi.get()))

    # ---------------------------------------------------------------- §2.2 heaps
    def sift_down(self) -> ir.Function:
        """libstdc++ __adjust_heap(base, hole, len, value) followed by __push_heap."""
        def body(f: Fn):
            K, I, base, hole0, ln, *elem = f.args
            vk = self.key_of(f.b, elem)
            b = f.b
            one, two = const(i64, 1), const(i64, 2)
            hole, child = f.var(i64, hole0, "hole"), f.var(i64, hole0, "child")
            half = b.sdiv(b.sub(ln, one), two)
            with f.while_(lambda: b.icmp_signed("<", child.get(), half)):
                c = b.add(b.mul(child.get(), two), two)
                kc = self.key_at(f, K, b.add(base, c))
                kl = self.key_at(f, K, b.add(base, b.sub(c, one)))
                c = b.select(self.lt(b, kc, kl), b.sub(c, one), c)
                child.set(c)
                self._move(f, K, I, b.add(base, hole.get()), b.add(base, c))
                hole.set(c)
            even = b.icmp_unsigned("==", b.and_(ln, one), const(i64, 0))
            lone = b.icmp_signed("==", child.get(), b.sdiv(b.sub(ln, two), two))
            with f.if_(b.and_(even, lone)):
                c = b.add(b.mul(child.get(), two), two)
                self._move(f, K, I, b.add(base, hole.get()), b.add(base, b.sub(c, one)))
                hole.set(b.sub(c, one))
            parent = f.var(i64, b.sdiv(b.sub(hole.get(), one), two), "parent")

            def rising():  # parent is a valid slot even when hole == top, so no branch
                above = b.icmp_signed(">", hole.get(), hole0)
                kp = self.key_at(f, K, b.add(base, parent.get()))
                return b.and_(above, self.lt(b, kp, vk))
            with f.while_(rising):
                self._move(f, K, I, b.add(base, hole.get()), b.add(base, parent.get()))
                hole.set(parent.get())
                parent.set(b.sdiv(b.sub(hole.get(), one), two))
            self._put(f, K, I, b.add(base, hole.get()), elem)
        names = ["K", "I", "base", "hole", "len"] + [f"v{i}" for i in range(len(self.elem_types))]
        return self._fn("sift_down", void, [ptr, ptr, i64, i64, i64] + self.elem_types, names,
                        body)

    def make_heap(self) -> ir.Function:
        def body(f: Fn):
            K, I, first, last = f.args
            b = f.b
            ln = b.sub(last, first)
            with f.if_(b.icmp_signed("<", ln, const(i64, 2))):
                f.ret()
            start = b.sdiv(b.sub(ln, const(i64, 2)), const(i64, 2))
            with f.for_range(start, const(i64, -1), step=-1, name="p") as p:
                elem = self._get(f, K, I, b.add(first, p))
                b.call(self.sift_down(), [K, I, first, p, ln, *elem])
        return self._fn("make_heap", void, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)

    def pop_root_into(self, f: Fn, K, I, first, last, r):
        elem = self._get(f, K, I, r)
        self._move(f, K, I, r, first)
        f.b.call(self.sift_down(), [K, I, first, const(i64, 0), f.b.sub(last, first), *elem])

    def sort_heap(self) -> ir.Function:
        def body(f: Fn):
            K, I, first, last0 = f.args
            b = f.b
            last = f.var(i64, last0, "last")
            with f.while_(lambda: b.icmp_signed(">", b.sub(last.get(), first), const(i64, 1))):
                last.set(b.sub(last.get(), const(i64, 1)))
                self.pop_root_into(f, K, I, first, last.get(), last.get())
        return self._fn("sort_heap", void, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)

    def heap_select(self) -> ir.Function:
        def body(f: Fn):
            K, I, first, middle, last = f.args
            b = f.b
            b.call(self.make_heap(), [K, I, first, middle])
            with f.for_range(middle, last) as i:
                with f.if_(self.lt(b, self.key_at(f, K, i), self.key_at(f, K, first))):
                    self.pop_root_into(f, K, I, first, middle, i)
        return self._fn("heap_select", void, [ptr, ptr, i64, i64, i64],
                        ["K", "I", "first", "middle", "last"], body)

    # ---------------------------------------------------------------- insertion sorts
    def _unguarded_insert(self, f: Fn, K, I, i):
        b = f.b
        elem = self._get(f, K, I, i)
        vk = self.key_of(b, elem)
        j = f.var(i64, b.sub(i, const(i64, 1)), "j")
        with f.while_(lambda: self.lt(b, vk, self.key_at(f, K, j.get()))):
            self._move(f, K, I, b.add(j.get(), const(i64, 1)), j.get())
            j.set(b.sub(j.get(), const(i64, 1)))
        self._put(f, K, I, b.add(j.get(), const(i64, 1)), elem)

    def guarded_insertion_sort(self) -> ir.Function:
        def body(f: Fn):
            K, I, first, last = f.args
            b = f.b
            with f.for_range(b.add(first, const(i64, 1)), last) as i:
                elem = self._get(f, K, I, i)
                with f.if_else(self.lt(b, self.key_of(b, elem),
                                       self.key_at(f, K, first))) as (front, other):
                    with front:
                        with f.for_range(i, first, step=-1, name="s") as s:
                            self._move(f, K, I, s, b.sub(s, const(i64, 1)))
                        self._put(f, K, I, first, elem)
                    with other:
                        self._unguarded_insert(f, K, I, i)
        return self._fn("insertion_sort", void, [ptr, ptr, i64, i64],
                        ["K", "I", "first", "last"], body)

    def final_insertion_sort(self, f: Fn, K, I, first, last):
        b = f.b
        t = const(i64, THRESHOLD)
        with f.if_else(b.icmp_signed(">", b.sub(last, first), t)) as (big, small):
            with big:
                b.call(self.guarded_insertion_sort(), [K, I, first, b.add(first, t)])
                with f.for_range(b.add(first, t), last) as i:
                    self._unguarded_insert(f, K, I, i)
            with small:
                b.call(self.guarded_insertion_sort(), [K, I, first, last])

    def small_stable_sort(self) -> ir.Function:
        """Stable sort of at most 16 elements, without branches on the data.

        By the §2.1 theorem, std::sort's final insertion pass equals a stable sort of each
        segment the partition loop leaves (segments are already in order relative to each
        other; heapsorted ranges are sorted), so this replaces it exactly. Packed words go
        through a sorting network, other elements through rank counting.
        """
        if self.packed:
            return self._fn("small_sort", void, [ptr, ptr, i64, i64],
                            ["K", "I", "first", "last"], self._network_sort_body)
        W = THRESHOLD

        def body(f: Fn):
            K, I, first, last = f.args
            b = f.b
            m = b.sub(last, first)
            et = self.elem_types[0]  # the key, or the packed word
            kt = self.kt
            # Load the segment straight into registers (the arrays are padded past the end);
            # lanes past the segment get the largest key, so they never rank before a real one.
            words = f.load_vec(et, W, K, first)
            if self.packed:
                keys = b.trunc(b.ashr(words, ir.Constant(vec(i64, W), [32] * W)), vec(i32, W))
            else:
                keys = words
                idxs = f.load_vec(i32, W, I, first)
            lane = ir.Constant(vec(i64, W), list(range(W)))
            mvec = b.shuffle_vector(b.insert_element(ir.Constant(vec(i64, W), None), m,
                                                     const(i32, 0)),
                                    ir.Constant(vec(i64, W), None),
                                    ir.Constant(vec(i32, W), [0] * W))
            top = ir.Constant(vec(kt, W), [(1 << (kt.width - 1)) - 1] * W)
            keys = b.select(b.icmp_signed("<", lane, mvec), keys, top)
            with f.for_range(const(i64, 0), m, name="rank") as j:
                kj = b.extract_element(keys, j)
                splat = b.insert_element(ir.Constant(vec(kt, W), None), kj, const(i32, 0))
                splat = b.shuffle_vector(splat, splat, ir.Constant(vec(i32, W), [0] * W))
                less = b.bitcast(b.icmp_signed("<", keys, splat), ir.IntType(W))
                same = b.bitcast(b.icmp_signed("==", keys, splat), ir.IntType(W))
                before = b.sub(b.shl(const(ir.IntType(W), 1), b.trunc(j, ir.IntType(W))),
                               const(ir.IntType(W), 1))
                r = b.add(f.call_intrinsic(f"llvm.ctpop.i{W}", ir.IntType(W), [less]),
                          f.call_intrinsic(f"llvm.ctpop.i{W}", ir.IntType(W),
                                           [b.and_(same, before)]))
                dst = b.add(first, b.zext(r, i64))
                f.store(b.extract_element(words, j), K, dst)
                if not self.packed:
                    f.store(b.extract_element(idxs, j), I, dst)
        return self._fn("small_sort", void, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)

    def _network_sort_body(self, f: Fn):
        """Stable sort of a leftover segment of packed (key << 32 | index) words by a bitonic
        network (``_sorted_network``): 8 lanes for segments of 8 or fewer (6 stages instead of
        10), 16 otherwise; one element is already sorted.
        """
        K, _, first, last = f.args
        b = f.b
        m = b.sub(last, first)
        with f.if_(b.icmp_signed("<=", m, const(i64, 1))):
            f.ret()
        with f.if_else(b.icmp_signed("<=", m, const(i64, 8))) as (narrow, wide):
            with narrow:
                self._network(f, K, first, m, 8)
            with wide:
                self._network(f, K, first, m, THRESHOLD)

    def network_sort(self, f: Fn, K, first, m):
        """Sort K[first:first+m] (m <= distinct_max packed words) by key, stably, inline in f:
        the narrowest network that holds m."""
        def emit(widths):
            if len(widths) == 1:
                self._network(f, K, first, m, widths[0])
                return
            with f.if_else(f.b.icmp_signed("<=", m, const(i64, widths[0]))) as (narrow, wide):
                with narrow:
                    self._network(f, K, first, m, widths[0])
                with wide:
                    emit(widths[1:])
        emit([w for w in (16, 32, 64) if w <= self.distinct_max])

    def _network(self, f: Fn, K, first, m, W: int):
        pay, _, live = self._sorted_network(f, K, first, m, W)
        self._store_words(f, K, first, pay, live)

    def _store_words(self, f: Fn, K, first, words, live):
        W = live.type.count
        store = intrinsic(self.m, f"llvm.masked.store.v{W}i64.p0", void,
                          [vec(i64, W), ptr, i32, vec(i1, W)])
        f.b.call(store, [words, f.gep(K, first, i64), const(i32, 8), live])

    def _sorted_network(self, f: Fn, K, first, m, W: int):
        """(sorted words, sorted composites, live lanes) of K[first:first+m], m <= W.

        Only the composites go through the network; each lane's word is then gathered from
        the (untouched) range by the position in its composite's low half."""
        b = f.b
        vt = vec(i64, W)
        words = f.load_vec(i64, W, K, first)  # the arrays are padded past the end
        lane = ir.Constant(vt, list(range(W)))
        mvec = b.shuffle_vector(b.insert_element(ir.Constant(vt, None), m, const(i32, 0)),
                                ir.Constant(vt, None), ir.Constant(vec(i32, W), [0] * W))
        live = b.icmp_signed("<", lane, mvec)
        high = ir.Constant(vt, [-(1 << 32)] * W)  # the key half of a word
        comp = b.select(live, b.or_(b.and_(words, high), lane),
                        ir.Constant(vt, [(0x7FFFFFFF << 32) | t for t in range(W)]))
        k = 2
        while k <= W:
            j = k // 2
            while j >= 1:
                pc = b.shuffle_vector(comp, comp, ir.Constant(vec(i32, W),
                                                              [t ^ j for t in range(W)]))
                # lane t takes the minimum of its pair iff it is the pair's lower lane in an
                # ascending block, or the upper lane in a descending one
                take_min = ir.Constant(vec(i1, W), [int(((t & j) == 0) == ((t & k) == 0))
                                                    for t in range(W)])
                lo = f.call_intrinsic(f"llvm.smin.v{W}i64", vt, [comp, pc])
                hi = f.call_intrinsic(f"llvm.smax.v{W}i64", vt, [comp, pc])
                comp = b.select(take_min, lo, hi)
                j //= 2
            k *= 2
        pos = b.and_(comp, ir.Constant(vt, [0xFFFFFFFF] * W))
        ptrs = b.gep(f.gep(K, first, i64), [pos], inbounds=True, source_etype=i64)
        ptrs.type = vec(ptr, W)  # llvmlite types a vector GEP as a scalar pointer
        gather = intrinsic(self.m, f"llvm.masked.gather.v{W}i64.v{W}p0", vt,
                           [vec(ptr, W), i32, vec(i1, W), vt])
        pay = b.call(gather, [ptrs, const(i32, 8), live, ir.Constant(vt, None)])
        return pay, comp, live

    def distinct_sort(self) -> ir.Function:
        """distinct_sort(K, I, first, last) -> sorted: a range of at most DISTINCT_MAX packed
        words whose keys are all different has one sorted order, whatever introsort would do
        on the way (partitions, heapsort), so a network sorts it; with a tie it returns false
        and leaves the range untouched for the exact path. Ties are rare in float rows and end
        up next to each other, so nearly every range at the bottom of the recursion takes this
        instead of its last partitions, each of which stalls on loads right after the
        previous level's scalar swaps."""
        widths = [w for w in (32, 64) if w <= self.distinct_max]

        def body(f: Fn):
            K, _, first, last = f.args
            b = f.b
            m = b.sub(last, first)
            # tie-heavy ranges: four probes sharing a key send them straight to the exact path
            probes = [self.key_at(f, K, p) for p in (
                first, b.add(first, const(i64, 1)),
                b.add(first, b.sdiv(m, const(i64, 2))), b.sub(last, const(i64, 1)))]
            same = [b.icmp_signed("==", probes[x], probes[y])
                    for x in range(4) for y in range(x + 1, 4)]
            any_same = same[0]
            for c in same[1:]:
                any_same = b.or_(any_same, c)
            with f.if_(any_same):
                f.ret(const(i1, 0))

            def attempt(W):
                pay, comp, live = self._sorted_network(f, K, first, m, W)
                keys = b.ashr(comp, ir.Constant(vec(i64, W), [32] * W))
                nxt = b.shuffle_vector(keys, keys, ir.Constant(
                    vec(i32, W), [min(t + 1, W - 1) for t in range(W)]))
                lane = ir.Constant(vec(i64, W), list(range(W)))
                m1 = b.sub(m, const(i64, 1))
                pairs = b.icmp_signed("<", lane, b.shuffle_vector(
                    b.insert_element(ir.Constant(vec(i64, W), None), m1, const(i32, 0)),
                    ir.Constant(vec(i64, W), None), ir.Constant(vec(i32, W), [0] * W)))
                tie = b.bitcast(b.and_(b.icmp_signed("==", keys, nxt), pairs), ir.IntType(W))
                with f.if_(b.icmp_unsigned("!=", tie, const(ir.IntType(W), 0))):
                    f.ret(const(i1, 0))
                self._store_words(f, K, first, pay, live)
                f.ret(const(i1, 1))
            if len(widths) == 1:
                attempt(widths[0])
            else:
                with f.if_(b.icmp_signed("<=", m, const(i64, widths[0]))):
                    attempt(widths[0])
                attempt(widths[1])
        return self._fn("distinct_sort", i1, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)

    def equal_subtree(self) -> ir.Function:
        """equal_subtree(K, I, first, last, depth) -> done: the whole introsort subtree of a
        range whose keys are all equal, when its depth budget never runs out.

        On such a range every partition is fixed by the size alone: median-of-three picks mid
        (no key is less than another), so K[first] and K[mid] swap; every element stops both
        Hoare scans, so [first+1, last) reverses; cut = first + 1 + (m-1)//2; both parts recurse
        with depth - 1, down to 16 elements, whose stable sort keeps them in place. So one check
        of the keys, then swaps and vector reversals level by level (``equal_tree``), with no
        compares, masks or leaf sorts. Returns false (nothing touched) when the keys differ or
        the depth would reach 0 (heapsort) above 16 elements.
        """
        V = 64

        def body(f: Fn):
            K, _, first, last, depth = f.args
            b = f.b
            one, zero = const(i64, 1), const(i64, 0)
            m = b.sub(last, first)
            levels, size = f.var(i64, zero, "levels"), f.var(i64, m, "size")
            with f.while_(lambda: b.icmp_signed(">", size.get(), const(i64, THRESHOLD))):
                size.set(b.add(one, b.ashr(b.sub(size.get(), one), one)))
                levels.set(b.add(levels.get(), one))
            with f.if_(b.icmp_signed("<", depth, levels.get())):
                f.ret(const(i1, 0))
            # all keys equal: compare the words' key halves, 64 at a time
            high = ir.Constant(vec(i64, V), [-(1 << 32)] * V)
            pkey = b.and_(f.load(i64, K, first), const(i64, -(1 << 32)))
            splat = b.shuffle_vector(b.insert_element(ir.Constant(vec(i64, V), None), pkey,
                                                      const(i32, 0)),
                                     ir.Constant(vec(i64, V), None),
                                     ir.Constant(vec(i32, V), [0] * V))
            full = b.add(first, b.and_(m, const(i64, -V)))
            with f.for_range(first, full, step=V, name="eqv") as j:
                w = f.load_vec(i64, V, K, j)
                diff = b.bitcast(b.icmp_unsigned("!=", b.and_(w, high), splat), ir.IntType(V))
                with f.if_(b.icmp_unsigned("!=", diff, const(ir.IntType(V), 0))):
                    f.ret(const(i1, 0))
            with f.for_range(full, last, name="eqt") as j:
                w = f.load(i64, K, j)
                with f.if_(b.icmp_unsigned("!=", b.and_(w, const(i64, -(1 << 32))), pkey)):
                    f.ret(const(i1, 0))
            b.call(self.equal_tree(), [K, first, last])
            f.ret(const(i1, 1))
        return self._fn("equal_subtree", i1, [ptr, ptr, i64, i64, i64],
                        ["K", "I", "first", "last", "depth"], body)

    def equal_tree(self) -> ir.Function:
        """equal_tree(K, first, last): introsort's partitions of an all-equal range (see
        equal_subtree), each a swap and a reversal of packed words, 8 per vector step."""
        def body(f: Fn):
            K, first, last0 = f.args
            b = f.b
            one, two = const(i64, 1), const(i64, 2)
            last = f.var(i64, last0, "last")
            with f.while_(lambda: b.icmp_signed(">", b.sub(last.get(), first),
                                                const(i64, THRESHOLD))):
                lst = last.get()
                m = b.sub(lst, first)
                self.swap(f, K, None, first, b.add(first, b.sdiv(m, two)))
                n_rev = b.sdiv(b.sub(m, one), two)
                self._reverse(f, K, b.add(first, one), lst, n_rev)
                cut = b.add(b.add(first, one), n_rev)
                b.call(f.fn, [K, cut, lst])
                last.set(cut)
        return self._fn("equal_tree", void, [ptr, i64, i64], ["K", "first", "last"], body)

    def _reverse(self, f: Fn, K, lo, hi, n_rev):
        """Swap (lo + i, hi - 1 - i) for i < n_rev: whole vectors of packed words from both
        ends, then one by one."""
        b = f.b
        V = 8
        rev = ir.Constant(vec(i32, V), list(range(V - 1, -1, -1)))
        start = b.and_(n_rev, const(i64, -V))
        with f.for_range(const(i64, 0), start, step=V, name="vrev") as i:
            lp = b.add(lo, i)
            rp = b.sub(b.sub(hi, i), const(i64, V))
            left = f.load_vec(i64, V, K, lp)
            right = f.load_vec(i64, V, K, rp)
            b.store(b.shuffle_vector(right, right, rev), f.gep(K, lp, i64), align=8)
            b.store(b.shuffle_vector(left, left, rev), f.gep(K, rp, i64), align=8)
        with f.for_range(start, n_rev, name="rev") as i:
            self.swap(f, K, None, b.add(lo, i), b.sub(b.sub(hi, const(i64, 1)), i))

    # ---------------------------------------------------------------- std::sort, nth_element
    def introsort_loop(self) -> ir.Function:
        def body(f: Fn):
            K, I, first, last0, depth0 = f.args
            b = f.b
            last, depth = f.var(i64, last0, "last"), f.var(i64, depth0, "depth")
            with f.while_(lambda: b.icmp_signed(">", b.sub(last.get(), first),
                                                const(i64, THRESHOLD))):
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


def radix_digits(key_type: ir.IntType) -> list[tuple[int, int]]:
    """(shift, bits) of each LSD pass: 11-bit digits for 32-bit keys (three passes, their
    counters fit in L1), bytes for 64-bit keys."""
    width, step = key_type.width, (11 if key_type.width == 32 else 8)
    return [(s, min(step, width - s)) for s in range(0, width, step)]


def radix_hist_bytes(key_type: ir.IntType) -> int:
    return sum(1 << bits for _, bits in radix_digits(key_type)) * 8


def emit_radix_sort(module: ir.Module, key_type: ir.IntType, name: str) -> ir.Function:
    """Stable ascending sort of signed integer keys with their i32 indices (LSD radix).

    ``radix(K, I, K2, I2, hist, n) -> i1``: true when the result ended in (K2, I2). ``hist`` holds
    ``radix_hist_bytes`` of i64 counters. Passes whose digit is the same for every key are
    skipped.
    """
    digits = radix_digits(key_type)
    bases, total = [], 0
    for _, bits in digits:
        bases.append(total)
        total += 1 << bits
    f = Fn(module, name, i1, [ptr, ptr, ptr, ptr, ptr, i64], ["K", "I", "K2", "I2", "H", "n"])
    K, I, K2, I2, H, n = f.args
    b = f.b
    kt = key_type
    sign = const(kt, 1 << (kt.width - 1))
    zero = const(i64, 0)

    def digit(key, p):
        shift, bits = digits[p]
        d = b.and_(b.lshr(b.xor(key, sign), const(kt, shift)), const(kt, (1 << bits) - 1))
        return b.add(b.zext(d, i64) if kt.width < 64 else d, const(i64, bases[p]))
    with f.for_range(0, total, name="z") as z:
        f.store(zero, H, z)
    with f.for_range(zero, n, name="h") as i:
        key = f.load(kt, K, i)
        for p in range(len(digits)):
            slot = digit(key, p)
            f.store(b.add(f.load(i64, H, slot), const(i64, 1)), H, slot)
    src_k, src_i = f.var(ptr, K, "sk"), f.var(ptr, I, "si")
    dst_k, dst_i = f.var(ptr, K2, "dk"), f.var(ptr, I2, "di")
    flipped = f.var(i1, const(i1, 0), "flipped")
    for p, (_, bits) in enumerate(digits):
        # skip a pass whose digit is constant: its bucket holds every key
        d0 = digit(f.load(kt, src_k.get(), zero), p)
        with f.if_(b.icmp_signed("!=", f.load(i64, H, d0), n)):
            run = f.var(i64, zero, "run")
            with f.for_range(bases[p], bases[p] + (1 << bits), name="pre") as slot:
                c = f.load(i64, H, slot)
                f.store(run.get(), H, slot)
                run.set(b.add(run.get(), c))
            sk, si, dk, di = src_k.get(), src_i.get(), dst_k.get(), dst_i.get()
            with f.for_range(zero, n, name="scatter") as i:
                key = f.load(kt, sk, i)
                slot = digit(key, p)
                pos = f.load(i64, H, slot)
                f.store(b.add(pos, const(i64, 1)), H, slot)
                f.store(key, dk, pos)
                f.store(f.load(i32, si, i), di, pos)
            src_k.set(dk)
            src_i.set(di)
            dst_k.set(sk)
            dst_i.set(si)
            flipped.set(b.xor(flipped.get(), const(i1, 1)))
    f.ret(flipped.get())
    return f.finish()
