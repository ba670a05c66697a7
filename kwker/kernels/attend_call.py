"""One native call for an append-and-attend step's kernels (kernels/kv_cache.py).

In place, a decode layer's step runs up to four kernels: the new keys' copy into their rows of
the cache (or, for a Llama, the rotations of q into a scratch and of the keys into their rows),
the values' copy, and the attention. Called one by one from Python, each paid a ctypes call and
the packing of its table of strides, several times their warm price after the weights' stream
has evicted the caches (a Llama decode layer, Xeon with AMX: 21 us of rotations and copies
around a 22 us attention). Here one function made by codegen/chain.py calls them in turn, their
constant arguments (entry points, sizes, strides) in a table of words built once per layout of
the operands and buffers; each call passes only the data pointers and the key count.
"""
from __future__ import annotations

import struct

import torch

from ..runtime.kernel import get_kernel
from ._call import entry
from .specs import ChainSpec

# the tensor arguments of the call, in order
TENSORS = ("q", "cos", "sin", "q_rotated", "new_k", "k_rows", "new_v", "v_rows", "keys",
           "values", "out")
T = {name: f"t{i}" for i, name in enumerate(TENSORS)}
ROPE_INTS = 12   # the rope entry's i64 arguments before the thread count


def _spec(rope: bool) -> ChainSpec:
    """The call's kernels as chain tokens (``ChainSpec``): words are numbered in the order
    ``OneCall._words`` lays them out."""
    at = iter(range(64))

    def words(n: int) -> str:
        return " ".join(f"w{next(at)}" for _ in range(n))
    calls = []
    if rope:   # rope(x, cos, sin, out, 12 ints, threads), q into its scratch, then the keys
        calls.append(f"{words(1)} {T['q']} {T['cos']} {T['sin']} {T['q_rotated']} "
                     f"{words(ROPE_INTS)} n")
        calls.append(f"{words(1)} {T['new_k']} {T['cos']} {T['sin']} {T['k_rows']} "
                     f"{words(ROPE_INTS)} n")
    else:      # row copy(src, dst, table)
        calls.append(f"{words(1)} {T['new_k']} {T['k_rows']} {words(1)}")
    calls.append(f"{words(1)} {T['new_v']} {T['v_rows']} {words(1)}")
    q = T["q_rotated"] if rope else T["q"]   # attention(q, k, v, mask, out, table, b, lq, lk)
    calls.append(f"{words(1)} {q} {T['keys']} {T['values']} z {T['out']} {words(3)} r n")
    return ChainSpec(tuple(calls), (), len(TENSORS))


class OneCall:
    """``call(layout, ptrs, lk, threads)``: the step's kernels in one native call. ``layout``
    (a tuple: see ``_words``) gives the word table, made on its first call; ``ptrs`` are the data
    pointers in ``TENSORS`` order (None where unused), ``lk`` the key count after the append."""

    def __init__(self, rope_spec, copy_k_spec, copy_v_spec, attend_spec, size: int,
                 b: int, lq: int):
        self.rope = rope_spec is not None
        self.fn = entry(_spec(self.rope), 2 + len(TENSORS), 2)
        self.addr = {"rope": get_kernel(rope_spec) if self.rope else None,
                     "copy_k": get_kernel(copy_k_spec), "copy_v": get_kernel(copy_v_spec),
                     "attend": get_kernel(attend_spec)}
        self.size, self.b, self.lq = size, b, lq
        self.tables: dict = {}     # key -> (word table, the tensors its words point into)

    def table(self, layout: tuple) -> int:
        """The address of the word table for ``layout``."""
        made = self.tables.get(layout)
        if made is None:
            if len(self.tables) >= 64:   # buffers regrow and layouts come and go
                self.tables.clear()
            made = self.tables[layout] = self._words(*layout)
        return made[0].data_ptr()

    def _words(self, q, q_rotated, new_k, new_v, out_stride, k_stride, v_stride, over_q,
               over_k) -> tuple:
        """(word table, the tensors its words point into) for the operands' (shape, element
        strides) ``q``, ``new_k`` and ``new_v``, the rotated q's strides (rope), the output's
        strides, the buffers' strides and cos's strides over q and over the keys (rope)."""
        size, words, kept = self.size, [], []

        def pointer(values, fmt) -> int:
            t = torch.frombuffer(bytearray(struct.pack(fmt, *values)), dtype=torch.int64)
            kept.append(t)
            return t.data_ptr()

        def rope_words(x, over, out):
            (bx, hx, tx, _), st = x
            return [self.addr["rope"], bx * hx * tx, hx, tx, *st[:3], *over, *out[:3]]

        def copy_words(kind, x, dst):
            return [self.addr[kind], pointer([*x[0][:3], *(s * size for s in x[1][:3]),
                                              *(s * size for s in dst[:3])], "9q")]
        if self.rope:
            words += rope_words(q, over_q, q_rotated) + rope_words(new_k, over_k, k_stride)
        else:
            words += copy_words("copy_k", new_k, k_stride)
        words += copy_words("copy_v", new_v, v_stride)
        q_stride = q_rotated if self.rope else q[1]
        words += [self.addr["attend"],
                  pointer([*q_stride, *k_stride, *v_stride, *out_stride], "16q"),
                  self.b, self.lq]
        return torch.tensor(words, dtype=torch.int64), kept

    def __call__(self, layout: tuple, ptrs: tuple, lk: int, threads: int) -> None:
        self.fn(self.table(layout), None, *ptrs, lk, threads)
