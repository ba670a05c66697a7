"""Calling a JIT'd eager kernel: pack an i64 argument block, make one ctypes call.

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
