"""Copies of tensors on transparent huge pages, for the weights decode kernels stream each token.

A decode token reads every weight once, from memory. On 4 KB pages each page of a stream costs
a TLB miss, and in a virtual machine (where cloud CPUs run) each miss walks two page tables.
On 2 MB pages the same reads ran faster: a 96 MB read on 2 threads, Zen 4 KVM guest, 23-29 ->
32-53 GB/s; GPT-2's 49 low-bit GEMVs 2.93 -> 2.53 ms (int4) and 4.0 -> 3.38 ms (int8), one
process, alternating.

Linux gives a private anonymous mapping huge pages where ``madvise(MADV_HUGEPAGE)`` asks for
them (``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``) and the range
covers whole aligned 2 MB blocks. A layer's weights are a few hundred KB to a few MB, too small
to cover one alone, so copies are carved one after another from shared ``CHUNK``-sized mappings
(a bump allocator: weights live as long as their model; a chunk is unmapped when no copy in it
is referenced). A request of a quarter chunk or more gets a mapping of its own. Where the
advice is refused (another OS, THP ``never``) the copies are ordinary memory, as fast as before.

Weights read in place rather than copied (torchao's int8 values) are moved instead: the tensor
keeps its identity on a huge-page storage (``move``), so the process holds one copy. Intel Xeon
with AMX (KVM guest), one process, alternating: GPT-2's 49 int8 decode GEMVs 6.7-7.3 -> 5.2-5.3
ms a token; compiled int8 decode, GPT-2 88.9 -> 107.0 tok/s, a Llama 74.9 -> 88.4.
"""
from __future__ import annotations

import ctypes
import math
import mmap
import threading

import torch

from .memory import libc_function

HUGE = 2 << 20                  # bytes of an x86-64 huge page
CHUNK = 16 << 20                # a live copy keeps its chunk's touched pages resident
ALIGN = 64
MADV_HUGEPAGE = 14
MOVED = "_kwker_huge_pages"     # set on a storage ``move`` made

_lock = threading.Lock()
_chunk: dict = {"view": None, "start": 0, "used": 0}
stats = {"chunks": 0, "advised_bytes": 0, "refused": 0}


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor on huge pages where the OS grants them."""
    nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return _take(nbytes).view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (CPU) on huge pages where the OS grants them."""
    return empty(t.shape, t.dtype).copy_(t)


def move(t: torch.Tensor) -> bool:
    """Move ``t``'s values onto huge pages in place, where they are all its storage holds:
    ``t`` stays the same tensor (shape, strides, dtype, values; its version counter bumps) on
    a huge-page storage, and its old storage is freed once nothing else holds it. For weights
    read in place that a copy would double (torchao's int8 values). Returns whether it moved;
    left as they are: tensors already moved, views into larger storages, tensors that need
    grad, inference tensors (no in-place change allowed outside inference mode), shared
    memory and storages mapped from a file (their pages are the file's)."""
    storage = t.untyped_storage()
    if getattr(storage, MOVED, False) or t.device.type != "cpu" or t.requires_grad or \
            t.is_inference() or not t.is_contiguous() or t.storage_offset() != 0 or \
            storage.nbytes() != t.numel() * t.element_size() or storage.is_shared() or \
            storage.filename is not None or t.numel() == 0:
        return False
    new = copy(t)   # (ordinary memory where the OS refuses: as good as the old)
    with torch.no_grad():
        t.set_(new.untyped_storage(), 0, t.shape, t.stride())
    setattr(t.untyped_storage(), MOVED, True)
    return True


def _take(nbytes: int) -> torch.Tensor:
    """``nbytes`` uint8 at a 64-byte aligned address of a huge-page mapping, as a storage of
    its own (a view of the mapping's memory that keeps it mapped): code that tells tensors
    apart by their storage (the KV cache's state, aliasing checks) sees separate tensors. Where
    no mapping can be made (address space or map count exhausted) it is ordinary memory."""
    try:
        return _carve(nbytes)
    except OSError:
        stats["refused"] += 1
        return torch.empty(nbytes, dtype=torch.uint8)


def _carve(nbytes: int) -> torch.Tensor:
    if nbytes >= CHUNK // 4:
        view, start = _mapping(nbytes)
    else:
        with _lock:
            view, used = _chunk["view"], _chunk["used"]
            if view is None or used + nbytes > len(view) - _chunk["start"]:
                view, start = _mapping(CHUNK)
                _chunk.update(view=view, start=start, used=0)
                used = 0
            start = _chunk["start"] + used
            _chunk["used"] = used + -(-nbytes // ALIGN) * ALIGN
    return torch.frombuffer(view[start:start + nbytes], dtype=torch.uint8)


def _mapping(nbytes: int) -> tuple[memoryview, int]:
    """(the memory of a fresh anonymous mapping of at least ``nbytes`` past ``start``, start):
    ``start`` is the mapping's first 2 MB boundary, from which it is advised for huge pages.
    The mapping stays until no view of it is left (the mmap object lives in them)."""
    size = -(-nbytes // HUGE) * HUGE
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(m)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = -(-addr // HUGE) * HUGE - addr
    stats["chunks"] += 1
    if _advise(addr + start, size):
        stats["advised_bytes"] += size
    else:
        stats["refused"] += 1
    return view, start


def _advise(addr: int, size: int) -> bool:
    madvise = libc_function("madvise")
    return madvise is not None and \
        madvise(ctypes.c_void_p(addr), ctypes.c_size_t(size), MADV_HUGEPAGE) == 0
