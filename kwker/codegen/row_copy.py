"""Rows of a fixed byte length copied between strided 3-D layouts: a KV cache's new rows
written into its buffer (kernels/kv_cache.py), inside the step that then attends over them.

    void sym(ptr src, ptr dst, ptr table)

``table`` holds nine i64: the sizes ``n0, n1, n2``, then the byte strides of src and of dst over
those three dims. Each row is ``spec.row_bytes`` contiguous bytes in both. A decode step copies
a few KB (GPT-2: 12 rows of 256 bytes a cache), so one thread and no vector loop beyond what
LLVM makes of a constant-size ``memcpy``.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i8, i64, intrinsic, new_module, ptr, void


def emit(spec, target):
    if spec.row_bytes < 1:
        raise ValueError(f"kwker: row_copy of {spec.row_bytes} bytes a row")
    module = new_module(spec.symbol)
    f = Fn(module, spec.symbol, void, [ptr, ptr, ptr], ["src", "dst", "table"], internal=False)
    b = f.b
    src, dst, table = f.args
    n = [f.load(i64, table, const(i64, d)) for d in range(3)]
    ss = [f.load(i64, table, const(i64, 3 + d)) for d in range(3)]
    ds = [f.load(i64, table, const(i64, 6 + d)) for d in range(3)]
    memcpy = intrinsic(module, "llvm.memcpy.p0.p0.i64", void, [ptr, ptr, i64, i1])
    with f.for_range(0, n[0], name="a") as a:
        with f.for_range(0, n[1], name="h") as h:
            with f.for_range(0, n[2], name="t") as t:
                def at(base, st):
                    off = b.add(b.add(b.mul(a, st[0]), b.mul(h, st[1])), b.mul(t, st[2]))
                    return f.gep(base, off, i8)
                b.call(memcpy, [at(dst, ds), at(src, ss), const(i64, spec.row_bytes),
                                ir.Constant(i1, 0)])
    f.finish()
    return module
