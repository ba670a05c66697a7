"""All-equal ranges of packed words: introsort's whole subtree without compares.

Where the output is provably the same, a faster equivalent replaces a step: a range whose keys are
all equal has partitions fixed by its length alone, so its whole subtree is swaps and vector
reversals (``equal_subtree``).
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, ptr, vec, void
from .sort_base import THRESHOLD, SortAlgosBase


class EqualRangeAlgos(SortAlgosBase):
    """``equal_subtree``, ``equal_tree`` and the packed-word reversal they share with the
    partition's all-equal shortcut."""

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
