"""Short ranges: libstdc++'s insertion sorts, and the branch-free sorts that replace them.

Where the output is provably the same, a faster equivalent replaces a step (§2.1 theorem: the
final insertion pass equals a stable sort of each leftover segment): each leftover segment of
<= 16 elements is stably sorted by rank counting or, for packed (key << 32 | index) words, by a
sorting network; a packed range of <= 64 whose keys all differ has one sorted order, so a network
sorts it whatever introsort would do (``distinct_sort``).
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, intrinsic, ptr, vec, void
from .sort_base import THRESHOLD, SortAlgosBase


class SmallSortAlgos(SortAlgosBase):
    """Insertion sorts, the small stable sort, bitonic networks and ``distinct_sort``."""

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
        """Sort K[first:first+m] (m <= network_max packed words) by key, stably, inline in f:
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
        emit([w for w in (16, 32, 64) if w <= self.network_max])

    def _network(self, f: Fn, K, first, m, W: int):
        pay, _, live = self._sorted_network(f, K, first, m, W)
        self._store_words(f, K, first, m, pay, live)

    def _store_words(self, f: Fn, K, first, m, words, live):
        """K[first:first+m] = the first m lanes of ``words`` (``live``: lane < m).

        AVX-512 stores under a mask register. AVX2's masked store (vpmaskmovq) is slow on AMD
        cores, and LLVM splits a wide one into one per 4 words; there the words go through a
        stack copy, whole 4-word groups are stored plainly and only the last one under a
        mask."""
        W = live.type.count
        b = f.b
        if self.lanes >= 8 or W <= 4:
            store = intrinsic(self.m, f"llvm.masked.store.v{W}i64.p0", void,
                              [vec(i64, W), ptr, i32, vec(i1, W)])
            b.call(store, [words, f.gep(K, first, i64), const(i32, 8), live])
            return
        buf = f.array(i64, W, "net_out")
        b.store(words, buf, align=8)
        whole = b.and_(m, const(i64, -4))
        dst = f.gep(K, first, i64)
        with f.for_range(const(i64, 0), whole, step=4, name="net_st") as j:
            f.b.store(f.load_vec(i64, 4, buf, j), f.gep(dst, j, i64), align=8)
        tail = b.sub(m, whole)
        with f.if_(b.icmp_signed(">", tail, const(i64, 0))):
            v4 = vec(i64, 4)
            splat = b.shuffle_vector(b.insert_element(ir.Constant(v4, None), tail,
                                                      const(i32, 0)),
                                     ir.Constant(v4, None), ir.Constant(vec(i32, 4), [0] * 4))
            store = intrinsic(self.m, "llvm.masked.store.v4i64.p0", void,
                              [v4, ptr, i32, vec(i1, 4)])
            b.call(store, [f.load_vec(i64, 4, buf, whole), f.gep(dst, whole, i64),
                           const(i32, 8),
                           b.icmp_signed("<", ir.Constant(v4, [0, 1, 2, 3]), splat)])

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
        # Lanes past m sort last and keep their own position (< W), which the padded load
        # above read already, so every lane may load. On AVX2 LLVM expands a gather into one
        # load per lane; under a mask each also tests and branches.
        mask = live if self.lanes >= 8 else ir.Constant(vec(i1, W), [1] * W)
        pay = b.call(gather, [ptrs, const(i32, 8), mask, ir.Constant(vt, None)])
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
                self._store_words(f, K, first, m, pay, live)
                f.ret(const(i1, 1))
            if len(widths) == 1:
                attempt(widths[0])
            else:
                with f.if_(b.icmp_signed("<=", m, const(i64, widths[0]))):
                    attempt(widths[0])
                attempt(widths[1])
        return self._fn("distinct_sort", i1, [ptr, ptr, i64, i64], ["K", "I", "first", "last"],
                        body)
