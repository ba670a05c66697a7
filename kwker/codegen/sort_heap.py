"""§2.2 heaps, exactly as libstdc++ builds and pops them.

They are introsort's and nth_element's fallback when the depth budget runs out, and topk's heap
path.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i64, ptr, void
from .sort_base import SortAlgosBase


class HeapAlgos(SortAlgosBase):
    """__adjust_heap / __push_heap, make_heap, sort_heap and heap_select."""

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
