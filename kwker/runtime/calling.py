"""Calling a JIT'd eager kernel: pack an i64 argument block, make one ctypes call; and the
row stride a row kernel is called with (``row_stride``, shared by the eager ops and the
kernel factories).

The block is packed with ``struct`` (about 0.4 us, several times cheaper than a ctypes array) and
passed as a read-only buffer. ctypes releases the GIL for the duration of the call, so several
Python threads can run kernels at once; each call owns its argument block and scratch memory.
"""
from __future__ import annotations

import ctypes
import struct

from .kernel import get_kernel

_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_fns: dict = {}
_packers: dict[int, struct.Struct] = {}


def kernel_function(spec):
    fn = _fns.get(spec)
    if fn is None:
        fn = _fns[spec] = _PROTO(get_kernel(spec))
    return fn


def call(spec, args: list[int]) -> None:
    packer = _packers.get(len(args))
    if packer is None:
        packer = _packers[len(args)] = struct.Struct(f"{len(args)}q")
    kernel_function(spec)(packer.pack(*args))


def row_stride(shape, strides, dim: int) -> int | None:
    """Stride between consecutive rows when every dim but ``dim`` collapses into one, else None.

    Rows enumerate the other dims in order (as ``movedim(dim, -1)`` does); this works on plain
    ints, so the common layouts need no view objects on the hot path.
    """
    rs, span = None, None
    for i in range(len(shape) - 1, -1, -1):
        if i == dim or shape[i] == 1:
            continue
        if rs is None:
            rs, span = strides[i], strides[i] * shape[i]
        elif strides[i] != span:
            return None
        else:
            span = strides[i] * shape[i]
    return 0 if rs is None else rs
