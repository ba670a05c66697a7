"""libstdc++'s heap primitives over (value, index) pairs, as ATen's topk heap path runs them.

The tie order of ``torch.topk`` comes from ``std::partial_sort``: ``make_heap`` on the first k
elements, then every later element that strictly precedes the root replaces it
(``__adjust_heap``), then ``sort_heap``. These functions reproduce that sequence step by step
(shared/aten-sorting-spec.md §2.2): the same sift-down with its lone-left-child case and push-up,
so equal scores end in the same slots as in ATen. The comparator is ATen's, NaN-aware:

    largest:  lt(a, b) = a > b or (isnan(a) and not isnan(b))     (NaN first)
    smallest: lt(a, b) = a < b or (not isnan(a) and isnan(b))     (NaN last)

Values are float32, indices i32. Fast-math: none (NaN tests must survive).
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import Fn, const, defined, f32, i1, i32, i64, ptr, void


def lt(b: ir.IRBuilder, x, y, largest: bool):
    """ATen's strict "goes before" on scalars or vectors (elementwise)."""
    nan_x = b.fcmp_unordered("uno", x, x)
    nan_y = b.fcmp_unordered("uno", y, y)
    if largest:
        return b.or_(b.fcmp_ordered(">", x, y), b.and_(nan_x, b.not_(nan_y)))
    return b.or_(b.fcmp_ordered("<", x, y), b.and_(b.not_(nan_x), nan_y))


class Heap:
    """Emitters of the heap routines for one comparator, declared once per module."""

    def __init__(self, module: ir.Module, largest: bool):
        self.m, self.largest = module, largest
        tag = "max" if largest else "min"
        self.sift = self._get(f"heap.{tag}.sift", self._emit_sift)
        self.make = self._get(f"heap.{tag}.make", self._emit_make)
        self.sort = self._get(f"heap.{tag}.sort", self._emit_sort)
        self.push = self._get(f"heap.{tag}.push", self._emit_push)

    def _get(self, name, build):
        return defined(self.m, name) or build(name)

    def _lt(self, b, x, y):
        return lt(b, x, y, self.largest)

    def _emit_sift(self, name):
        """``void sift(ptr hv, ptr hi, i64 hole, i64 len, f32 v, i32 vi)``: __adjust_heap."""
        f = Fn(self.m, name, void, [ptr, ptr, i64, i64, f32, i32],
               ["hv", "hi", "hole0", "len", "v", "vi"])
        hv, hi, hole0, n, v, vi = f.args
        b = f.b
        one, two = const(i64, 1), const(i64, 2)
        hole = f.var(i64, hole0, "hole")
        child = f.var(i64, hole0, "child")
        half = b.sdiv(b.sub(n, one), two)

        def move(dst, src):
            simd.store_scalar(b, simd.load_scalar(b, hv, src), hv, dst)
            simd.store_scalar(b, simd.load_scalar(b, hi, src, i32), hi, dst)

        with f.while_(lambda: b.icmp_signed("<", child.get(), half)):
            c = b.add(b.mul(child.get(), two), two)
            left = b.sub(c, one)
            take_left = self._lt(b, simd.load_scalar(b, hv, c), simd.load_scalar(b, hv, left))
            c = b.select(take_left, left, c)
            move(hole.get(), c)
            hole.set(c)
            child.set(c)
        even = b.icmp_signed("==", b.srem(n, two), const(i64, 0))
        lone = b.icmp_signed("==", child.get(), b.sdiv(b.sub(n, two), two))
        with f.if_(b.and_(even, lone)):
            c = b.add(b.mul(child.get(), two), one)
            move(hole.get(), c)
            hole.set(c)
        parent = f.var(i64, b.sdiv(b.sub(hole.get(), one), two), "parent")

        def up():
            above = b.icmp_signed(">", hole.get(), hole0)
            # evaluate the comparison only when there is a parent (hole > top >= 0)
            p = b.select(above, parent.get(), const(i64, 0))
            return b.and_(above, self._lt(b, simd.load_scalar(b, hv, p), v))

        with f.while_(up):
            move(hole.get(), parent.get())
            hole.set(parent.get())
            parent.set(b.sdiv(b.sub(hole.get(), one), two))
        simd.store_scalar(b, v, hv, hole.get())
        simd.store_scalar(b, vi, hi, hole.get())
        return f.finish()

    def _emit_make(self, name):
        """``void make(ptr hv, ptr hi, i64 len)``: std::make_heap."""
        f = Fn(self.m, name, void, [ptr, ptr, i64], ["hv", "hi", "len"])
        hv, hi, n = f.args
        b = f.b
        with f.if_(b.icmp_signed(">=", n, const(i64, 2))):
            start = b.sdiv(b.sub(n, const(i64, 2)), const(i64, 2))
            with f.for_range(start, const(i64, -1), step=-1, name="p") as p:
                b.call(self.sift, [hv, hi, p, n, simd.load_scalar(b, hv, p),
                                   simd.load_scalar(b, hi, p, i32)])
        return f.finish()

    def _emit_sort(self, name):
        """``void sort(ptr hv, ptr hi, i64 len)``: std::sort_heap."""
        f = Fn(self.m, name, void, [ptr, ptr, i64], ["hv", "hi", "len"])
        hv, hi, n = f.args
        b = f.b
        with f.for_range(b.sub(n, const(i64, 1)), const(i64, 0), step=-1, name="last") as last:
            v = simd.load_scalar(b, hv, last)
            vi = simd.load_scalar(b, hi, last, i32)
            simd.store_scalar(b, simd.load_scalar(b, hv, const(i64, 0)), hv, last)
            simd.store_scalar(b, simd.load_scalar(b, hi, const(i64, 0), i32), hi, last)
            b.call(self.sift, [hv, hi, const(i64, 0), last, v, vi])
        return f.finish()

    def _emit_push(self, name):
        """``i1 push(ptr hv, ptr hi, ptr cnt, i64 k, f32 v, i32 vi)``: one heap_select step.

        The first k elements fill the heap (made when full); later ones replace the root only
        if they strictly precede it. Returns whether the element entered the heap.
        """
        f = Fn(self.m, name, i1, [ptr, ptr, ptr, i64, f32, i32],
               ["hv", "hi", "cnt", "k", "v", "vi"])
        hv, hi, cnt, k, v, vi = f.args
        b = f.b
        n = b.load(cnt, typ=i64)
        with f.if_(b.icmp_signed("<", n, k)):
            simd.store_scalar(b, v, hv, n)
            simd.store_scalar(b, vi, hi, n)
            n1 = b.add(n, const(i64, 1))
            b.store(n1, cnt)
            with f.if_(b.icmp_signed("==", n1, k)):
                b.call(self.make, [hv, hi, k])
            f.ret(const(i1, 1))
        with f.if_(self._lt(b, v, simd.load_scalar(b, hv, const(i64, 0)))):
            b.call(self.sift, [hv, hi, const(i64, 0), k, v, vi])
            f.ret(const(i1, 1))
        f.ret(const(i1, 0))
        return f.finish()
