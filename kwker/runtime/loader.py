"""Object code -> callable function pointers.

All object files are added to one MCJIT engine. JIT'd kernels call the OpenMP runtime that torch
already loaded (libgomp), so their threads are torch's threads and follow torch.set_num_threads;
those symbols are registered with LLVM once, before the first object is linked.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import threading

import llvmlite.binding as llvm

from .compiler import target_machine
from .target import host_target

_OMP_SYMBOLS = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _gomp() -> ctypes.CDLL:
    import torch

    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    candidates = sorted(glob.glob(os.path.join(libdir, "libgomp*.so*")))
    if candidates:
        return ctypes.CDLL(candidates[0], mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)


@functools.lru_cache(maxsize=None)
def _engine() -> llvm.ExecutionEngine:
    lib = _gomp()
    for name in _OMP_SYMBOLS:
        llvm.add_symbol(name, ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
    for name in ("malloc", "free", "memcpy", "memset", "memmove"):
        llvm.add_symbol(name, ctypes.cast(getattr(ctypes.CDLL(None), name), ctypes.c_void_p).value)
    # The engine only links object files; its own (empty) module is never executed.
    return llvm.create_mcjit_compiler(llvm.parse_assembly(""), target_machine(host_target()))


_objects: list = []  # keep ObjectFileRefs alive for as long as their code may run


def load_symbols(obj: bytes, names: list[str]) -> dict[str, int]:
    """Link ``obj`` into the process and return the addresses of ``names``."""
    with _lock:
        engine = _engine()
        objfile = llvm.ObjectFileRef.from_data(obj)
        engine.add_object_file(objfile)
        engine.finalize_object()
        _objects.append(objfile)
        addresses = {n: engine.get_function_address(n) for n in names}
    missing = [n for n, a in addresses.items() if not a]
    if missing:
        raise RuntimeError(f"kwker: object code lacks symbols {missing}")
    return addresses
