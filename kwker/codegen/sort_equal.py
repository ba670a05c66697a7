"""All-equal ranges of packed words: introsort's whole subtree without compares.

Where the output is provably the same, a faster equivalent replaces a step: a range whose keys are
all equal has partitions fixed by its length alone, so its whole subtree is a known permutation
(``equal_subtree``), written in one pass from a copy of the range (``equal_tree``).
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, i1, i32, i64, ptr, vec, void
from .sort_base import THRESHOLD, SortAlgosBase

LEAF_VECTORS = 2   # 8-word vectors of a leaf past its first word (leaves hold at most 16 words)


class EqualRangeAlgos(SortAlgosBase):
    """``equal_subtree``, ``equal_tree``, and the packed-word reversal of the partition's
    all-equal shortcut."""

    def equal_subtree(self) -> ir.Function:
        """equal_subtree(K, ctx, first, last, depth) -> done: the whole introsort subtree of a
        range whose keys are all equal, when its depth budget never runs out (``ctx``: the
        presorted context, sort_presorted.py).

        On such a range every partition is fixed by the size alone: median-of-three picks mid
        (no key is less than another), so K[first] and K[mid] swap; every element stops both
        Hoare scans, so [first+1, last) reverses; cut = first + 1 + (m-1)//2; both parts recurse
        with depth - 1, down to 16 elements, whose stable sort keeps them in place. So one check
        of the keys, then the permutation all those levels make, written at once
        (``equal_tree``), with no compares, masks or leaf sorts. Returns false (nothing
        touched) when the keys differ or the depth would reach 0 (heapsort) above 16 elements.
        """
        V = 64

        def body(f: Fn):
            K, ctx, first, last, depth = f.args
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
            b.call(self.equal_tree(), [K, self.spare(f, ctx), first, last])
            f.ret(const(i1, 1))
        return self._fn("equal_subtree", i1, [ptr, ptr, i64, i64, i64],
                        ["K", "ctx", "first", "last", "depth"], body)

    def equal_tree(self) -> ir.Function:
        """equal_tree(K, X, first, last): introsort's partitions of an all-equal range (see
        ``equal_subtree``), from a copy of it in X[first:last] (the spare array).

        One partition of [first, last), n long: K[first] swaps with K[mid], mid = first + n//2,
        then [first+1, last) reverses, and cut = first + 1 + (n-1)//2 = last - n//2. So if the
        range holds c[first] = X[x0] and c[p] = X[a + s p] for p > first (s = +-1), then
        afterwards K[cut] = X[x0] (what K[mid] took from K[first], reversed to last - n//2 =
        cut), K[first] = X[a + s mid], and every other p holds X[a + s (first + last) - s p].
        Each part starts with its one exception and is affine past it, as the whole range was
        (a = 0, s = 1, x0 = first): both recurse on (a + s (first + last), -s) with x0
        unchanged on the right and a + s mid on the left. A leaf (16 words at most, which the
        final insertion sort leaves in place) is written from X: its first word, then a forward
        or reversed run. One copy and one write of each word, against a reversal of the whole
        range per level."""
        def body(f: Fn):
            K, X, first, last = f.args
            b = f.b
            self.copy_words(f, X, K, first, last)
            b.call(self._equal_parts(), [K, X, first, last, const(i64, 0), const(i64, 1),
                                         first])
        return self._fn("equal_tree", void, [ptr, ptr, i64, i64], ["K", "X", "first", "last"],
                        body)

    def _equal_parts(self) -> ir.Function:
        """equal_parts(K, X, first, last, a, s, x0): ``equal_tree``'s recursion on [first,
        last), whose words are X[x0] and then X[a + s p]."""
        def body(f: Fn):
            K, X, first, last0, a0, s0, x00 = f.args
            b = f.b
            two = const(i64, 2)
            last, a, s, x0 = (f.var(i64, v, nm) for v, nm in
                              ((last0, "last"), (a0, "a"), (s0, "s"), (x00, "x0")))
            with f.while_(lambda: b.icmp_signed(">", b.sub(last.get(), first),
                                                const(i64, THRESHOLD))):
                n = b.sub(last.get(), first)
                half = b.sdiv(n, two)
                cut = b.sub(last.get(), half)
                reflected = b.add(a.get(), b.mul(s.get(), b.add(first, last.get())))
                flipped = b.sub(const(i64, 0), s.get())
                b.call(f.fn, [K, X, cut, last.get(), reflected, flipped, x0.get()])
                x0.set(b.add(a.get(), b.mul(s.get(), b.add(first, half))))
                a.set(reflected)
                s.set(flipped)
                last.set(cut)
            self._equal_leaf(f, K, X, first, last.get(), a.get(), s.get(), x0.get())
        return self._fn("equal_parts", void, [ptr, ptr, i64, i64, i64, i64, i64],
                        ["K", "X", "first", "last", "a", "s", "x0"], body)

    def _equal_leaf(self, f: Fn, K, X, first, last, a, s, x0):
        """K[first] = X[x0], K[p] = X[a + s p] for first < p < last (at most 15 words): 8-word
        vectors read forward or reversed (reads past the range stay inside the spare array's
        padding), stores masked to the leaf."""
        b = f.b
        V = 8
        f.store(f.load(i64, X, x0), K, first)
        rest = b.sub(b.sub(last, first), const(i64, 1))
        forward = b.icmp_signed(">", s, const(i64, 0))
        start = b.add(a, b.mul(s, b.add(first, const(i64, 1))))  # X index of K[first + 1]
        rev = ir.Constant(vec(i32, V), list(range(V - 1, -1, -1)))
        for j in range(LEAF_VECTORS):
            at = b.select(forward, b.add(start, const(i64, V * j)),
                          b.sub(start, const(i64, V * j + V - 1)))
            words = f.load_vec(i64, V, X, at)
            words = b.select(forward, words, b.shuffle_vector(words, words, rev))
            mask = simd.lane_mask(b, V, b.sub(rest, const(i64, V * j)))
            simd.masked_store(b, words, K, b.add(first, const(i64, 1 + V * j)), mask, i64)

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
