"""Ranges without ties take their place in an already sorted copy of the row.

Every partition of std::sort leaves keys on the left no greater than keys on the right, and the
final stable pass never moves an element past one it does not strictly precede (§2.1 theorem).
So when introsort reaches a range [first, last), the elements there end up at exactly those
positions of the output. If no key in the range occurs twice in the whole row, those elements
are the ones at ranks first..last-1 of *any* sort of the row, in the one order distinct keys
have: the range's output is that slice of a sorted copy, whatever introsort would still do to it.

The row kernel (sort_full.py) sorts a copy first (the stable radix sort, packed into ``S``) and
flags in ``K`` every word whose key is tied somewhere in the row (bit 31 of the index half, free
because indices are below 2**31; every comparison here reads the key half or the whole word
against a key bound, so a flag changes no decision). A range holding no flagged word is copied
from ``S``; only ranges holding a tied key are partitioned. Random float rows hold a few tied
pairs, so the exact partitions stop after a few levels.

The ``I`` argument of a presorted set's functions is a context (``presorted_context``): the
sorted copy (null: none, introsort throughout) and a spare array as long as the row, whose slots
[first, last) the range [first, last) may use as it likes (sort_equal.py): ranges that introsort
reaches are disjoint, and a range the copy serves is not partitioned further.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i64, ptr, vec
from .sort_base import SortAlgosBase

TIED = 1 << 31  # the flag in a packed word's index half
SCAN = 16  # words per vector step of the flag scan


def presorted_context(f: Fn, sorted_words, spare) -> ir.Value:
    """The context (module doc) of a presorted set's functions, on ``f``'s stack."""
    ctx = f.array(ptr, 2, "presorted")
    f.store(sorted_words, ctx, const(i64, 0))
    f.store(spare, ctx, const(i64, 1))
    return ctx


class PresortedAlgos(SortAlgosBase):
    """``presorted_copy(K, S, first, last) -> copied``: the shortcut above (never, for a null
    ``S``); the context's two pointers."""

    def sorted_copy(self, f: Fn, ctx) -> ir.Value:
        return f.load(ptr, ctx, const(i64, 0))

    def spare(self, f: Fn, ctx) -> ir.Value:
        return f.load(ptr, ctx, const(i64, 1))

    def presorted_copy(self) -> ir.Function:
        def body(f: Fn):
            K, S, first, last = f.args
            b = f.b
            zero = const(i64, 0)
            vt = vec(i64, SCAN)
            flag = ir.Constant(vt, [TIED] * SCAN)
            with f.if_(b.icmp_unsigned("==", S, ir.Constant(ptr, None))):
                f.ret(const(i1, 0))  # no sorted copy: this row runs introsort throughout
            pos = f.var(i64, first, "pos")
            # the first flagged word ends the scan: ranges holding ties are the big ones at the
            # top of the recursion, where a flag turns up within the first few blocks
            with f.while_(lambda: b.icmp_signed("<=", b.add(pos.get(), const(i64, SCAN)),
                                                last)):
                w = b.and_(f.load_vec(i64, SCAN, K, pos.get()), flag)
                any_ = b.bitcast(b.icmp_unsigned("!=", w, ir.Constant(vt, [0] * SCAN)),
                                 ir.IntType(SCAN))
                with f.if_(b.icmp_unsigned("!=", any_, const(ir.IntType(SCAN), 0))):
                    f.ret(const(i1, 0))
                pos.set(b.add(pos.get(), const(i64, SCAN)))
            with f.for_range(pos.get(), last, name="tail") as j:
                with f.if_(b.icmp_unsigned("!=", b.and_(f.load(i64, K, j), const(i64, TIED)),
                                           zero)):
                    f.ret(const(i1, 0))
            self.copy_words(f, K, S, first, last)
            f.ret(const(i1, 1))
        return self._fn("presorted_copy", i1, [ptr, ptr, i64, i64], ["K", "S", "first", "last"],
                        body)
