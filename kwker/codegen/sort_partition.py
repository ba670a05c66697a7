"""§2.1's partition step, exactly: median of three to the front, then Hoare's scans.

Where the output is provably the same, a faster equivalent replaces a step: the Hoare partition
runs 64 positions at a time (vector compares -> stopper bitmasks -> pair the k-th left stopper
with the k-th right stopper, BlockQuicksort-style). Hoare's scans are a pairing of original
stoppers until the scans cross, so the swaps are the same; near the crossing the scalar loop takes
over from the exact Hoare state (lo, hi). A range whose keys all equal the pivot is reversed in
one pass (``_all_equal_shortcut``), which is what Hoare's scans do to it; where one scan stops at
every position it reaches, the other side's stoppers take the dense side's words 8 at a time
(``_one_sided``).
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, i1, i32, i64, intrinsic, ptr, vec
from .sort_base import BLOCKS, EQUAL_MIN, SortAlgosBase

# ranges at least this long try the one-sided scans first (``_one_sided``)
ONE_SIDED_MIN = 256


class PartitionAlgos(SortAlgosBase):
    """Median of three, Hoare (scalar, bitmask and block-wise) and the all-equal shortcut."""

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
                if self.presorted and self.word_permutes:
                    with f.if_(b.icmp_signed(">=", b.sub(last, first), const(i64, ONE_SIDED_MIN))):
                        self._one_sided(f, K, self.spare(f, I), first, lo, hi)
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

    # ---------------------------------------------------------------- one-sided partitions
    def _one_sided(self, f: Fn, K, X, first, lo, hi):
        """Hoare's scans where one of them stops at every position it reaches (packed words, on
        AVX-512 or AVX2: ``word_permutes``), from the state (lo, hi) = (first + 1, last) to an
        exact state the block pairs continue from: first the right scan (every word <= the
        pivot: a range of two keys whose larger one is the median of three), then the left one
        (every word >= it).

        Where the right scan stops everywhere, the k-th left stopper swaps with position
        last - k: the right side is consumed one position at a time. So the left stoppers are
        found a vector at a time (8 words; AVX2 4), each chunk takes the right side's next words
        (reversed) into its stopper lanes, and its own stoppers are compressed into the spare
        array ``X``'s slots from ``first``; the consumed run on the right is written from there
        at the end (it is only read before). The mirror image for the left. Each step first
        checks that the dense side's next vector of words are all stoppers, and stops (in an
        exact state) where one is not. A tie-heavy row spends most of its swaps in such
        partitions (randint(0, 4) rows of 20000: 74% of them), where the pairwise swaps cost a
        pair of bit scans each."""
        b = f.b
        pv = b.sext(self.key_at(f, K, first), i64)
        low_word = b.shl(pv, const(i64, 32))                     # the pivot's smallest word
        high_word = b.or_(low_word, const(i64, 0xFFFFFFFF))      # and its largest
        for dense_right in (True, False):
            self._one_sided_run(f, K, X, first, lo, hi, low_word, high_word, dense_right)

    def _one_sided_run(self, f: Fn, K, X, first, lo, hi, low_word, high_word,
                       dense_right: bool):
        """``_one_sided``'s swaps with the right scan stopping everywhere (``dense_right``), or
        the left one: while the dense side's next words are all stoppers and a chunk stays
        clear of them; (lo, hi) end as Hoare's state after the swaps made (the sparse side at
        its scanned frontier: its chunks' stoppers are all swapped)."""
        b = f.b
        V = self.lanes
        rev = ir.Constant(vec(i32, V), list(range(V - 1, -1, -1)))
        compress, expand = self._word_permutes(f, V)
        buf = f.gep(X, first, i64)
        count = f.var(i64, const(i64, 0), "pairs")

        low, high = simd.broadcast(b, low_word, V), simd.broadcast(b, high_word, V)
        rev_ = lambda w: b.shuffle_vector(w, w, rev)   # noqa: E731
        all_ = lambda c: b.icmp_unsigned("==", b.bitcast(c, ir.IntType(V)),   # noqa: E731
                                         const(ir.IntType(V), (1 << V) - 1))
        with f.loop():
            with f.if_(b.icmp_signed(">", b.add(lo.get(), const(i64, 2 * V)), hi.get())):
                f.break_()
            if dense_right:   # the right side's next words from hi - 1 down, all <= pivot
                theirs = rev_(f.load_vec(i64, V, K, b.sub(hi.get(), const(i64, V))))
                with f.if_(b.not_(all_(b.icmp_signed("<=", theirs, high)))):
                    f.break_()
                at = lo.get()      # a chunk from lo: its left stoppers, >= pivot
                words = f.load_vec(i64, V, K, at)
                stop = b.icmp_signed(">=", words, low)
            else:   # the left side's next words from lo up, all >= pivot
                theirs = f.load_vec(i64, V, K, lo.get())
                with f.if_(b.not_(all_(b.icmp_signed(">=", theirs, low)))):
                    f.break_()
                at = b.sub(hi.get(), const(i64, V))   # a chunk below hi, reversed
                words = rev_(f.load_vec(i64, V, K, at))
                stop = b.icmp_signed("<=", words, high)
            n = f.call_intrinsic("llvm.ctpop.i64", i64, [
                b.zext(b.bitcast(stop, ir.IntType(V)), i64)])
            b.store(compress(words, stop), f.gep(buf, count.get(), i64), align=8)
            placed = expand(theirs, words, stop)
            b.store(placed if dense_right else rev_(placed), f.gep(K, at, i64), align=8)
            count.set(b.add(count.get(), n))
            if dense_right:
                lo.set(b.add(lo.get(), const(i64, V)))
                hi.set(b.sub(hi.get(), n))
            else:
                lo.set(b.add(lo.get(), n))
                hi.set(at)
        # the dense side's consumed run takes the sparse side's stoppers, in the order found:
        # from where the run began down (right) or up (left)
        pairs = count.get()
        start = b.sub(lo.get(), pairs)   # (left: the run is [lo - pairs, lo))
        with f.for_range(const(i64, 0), pairs, step=V, name="run") as j:
            valid = simd.lane_mask(b, V, b.sub(pairs, j))
            words = f.load_vec(i64, V, buf, j)
            if dense_right:   # buf[j + t] goes to hi_end + pairs - 1 - j - t
                at = b.sub(b.sub(b.add(hi.get(), pairs), j), const(i64, V))
                simd.masked_store(b, rev_(words), K, at, rev_(valid), i64)
            else:             # buf[j + t] goes to start + j + t
                simd.masked_store(b, words, K, b.add(start, j), valid, i64)

    def _word_permutes(self, f: Fn, V: int):
        """(compress(words, mask), expand(theirs, words, mask)) of V packed words: the mask's
        lanes moved to the front in order, and the first lanes of ``theirs`` into the mask's
        lanes of ``words``. AVX-512 has both as instructions; on AVX2 they are ``vpermd``
        with a 16-entry index table each (a word is two dword lanes) and a blend."""
        b = f.b
        vt = vec(i64, V)
        if V == 8:
            def call(name):
                return lambda x, y, m: f.call_intrinsic(
                    f"llvm.x86.avx512.mask.{name}.v8i64", vt, [x, y, m])
            return (lambda w, m: call("compress")(w, w, m)), call("expand")
        assert V == 4
        dwords = vec(i32, 8)

        def table(name, order):
            full = f"{self.prefix}.{name}"
            g = self.m.globals.get(full)
            if g is None:
                rows = []
                for m in range(16):
                    src = order(m)
                    rows.append(ir.Constant(dwords, [2 * src[j] + h for j in range(4)
                                                     for h in (0, 1)]))
                g = ir.GlobalVariable(self.m, ir.ArrayType(dwords, 16), full)
                g.initializer = ir.Constant(ir.ArrayType(dwords, 16), rows)
                g.global_constant = True
                g.align = 32
            return g

        def compress_order(m):
            lanes = [j for j in range(4) if m >> j & 1]
            return lanes + [0] * (4 - len(lanes))

        def expand_order(m):   # lane j of a mask lane takes theirs[rank of j in the mask]
            return [bin(m & ((1 << j) - 1)).count("1") if m >> j & 1 else 0 for j in range(4)]
        tables = table("compress4", compress_order), table("expand4", expand_order)

        def permute(which, w, m):
            idx = b.zext(b.bitcast(m, ir.IntType(4)), i64)
            at = b.gep(tables[which], [const(i64, 0), idx], inbounds=True)
            order = b.load(at, typ=dwords, align=32)
            fn = intrinsic(self.m, "llvm.x86.avx2.permd", dwords, [dwords, dwords])
            return b.bitcast(b.call(fn, [b.bitcast(w, dwords), order]), vt)
        return ((lambda w, m: permute(0, w, m)),
                (lambda their, w, m: b.select(m, permute(1, their, m), w)))
