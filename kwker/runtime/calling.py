"""Calling a JIT'd eager kernel: pack an i64 argument block, make one ctypes call.

ctypes releases the GIL for the duration of the call, so several Python threads can run kernels
at once; each call owns its argument block and scratch memory.
"""
from __future__ import annotations

import ctypes

from .kernel import get_kernel

_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_fns: dict = {}


def kernel_function(spec):
    fn = _fns.get(spec)
    if fn is None:
        fn = _fns[spec] = _PROTO(get_kernel(spec))
    return fn


def call(spec, args: list[int]) -> None:
    block = (ctypes.c_int64 * len(args))(*args)
    kernel_function(spec)(ctypes.addressof(block))
