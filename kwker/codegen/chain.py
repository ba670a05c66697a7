"""Kernels called one after another from one native function: a chain (kernels/chain.py).

    void sym(ptr words, ptr scratch, ptr t0, ..., ptr t{T-1}, i64 rows, i64 threads)

Each call of ``spec.calls`` is made with the words its tokens name (specs.ChainSpec), every one
passed as an i64: the kernels' arguments are pointers and i64s, which the x86-64 C convention
passes alike, so one function type per arity serves every kernel. Scratch buffer i starts
``sum(align64(rows * scratch[j]) for j < i)`` bytes into ``scratch``.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, FunctionPointer, const, i8, i64, new_module, ptr, void

ALIGN = 64


def emit(spec, target):
    module = new_module(spec.symbol)
    names = ["words", "scratch"] + [f"t{j}" for j in range(spec.tensors)] + ["rows", "threads"]
    f = Fn(module, spec.symbol, void, [ptr, ptr] + [ptr] * spec.tensors + [i64, i64], names,
           internal=False)
    b = f.b
    words, scratch, *tensors = f.args[:2 + spec.tensors]
    rows, threads = f.args[-2:]
    starts, at = [], const(i64, 0)
    for per_row in spec.scratch:
        starts.append(f.gep(scratch, at, i8))
        size = b.mul(rows, const(i64, per_row))
        at = b.add(at, b.and_(b.add(size, const(i64, ALIGN - 1)), const(i64, -ALIGN)))

    def word(token: str) -> ir.Value:
        kind, index = token[0], int(token[1:] or 0)
        if kind == "w":
            return f.load(i64, words, const(i64, index))
        if kind == "t":
            return b.ptrtoint(tensors[index], i64)
        if kind == "s":
            return b.ptrtoint(starts[index], i64)
        if kind == "e":
            return b.mul(rows, const(i64, index))
        return {"r": rows, "n": threads, "z": const(i64, 0)}[kind]

    for call in spec.calls:
        entry_point, *args = call.split()
        callee = b.inttoptr(word(entry_point),
                            FunctionPointer(ir.FunctionType(void, [i64] * len(args))))
        b.call(callee, [word(t) for t in args])
    f.finish()
    return module
