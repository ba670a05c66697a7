"""Linux hands a process the AMX tile state only when asked: ask once, remember the answer.

Without the permission the first tile instruction raises SIGILL, so no tile kernel may run
before ``granted()`` returned True. The request is ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`` (Linux 5.16+); a second request is harmless. A refusal (an older kernel, a
sandbox that filters the call, a CPU without AMX) is kept with its reason, which the report and
``kwker-cache info`` show; the vector kernels then serve every product.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading

SYS_ARCH_PRCTL = 158            # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

_lock = threading.Lock()
_answer: list = []              # [(granted, reason)] once asked


def _arch_prctl(code: int, arg) -> tuple[int, int]:
    """(return value, errno) of the raw system call (glibc has no wrapper for these codes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    r = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg)
    return r, ctypes.get_errno()


def _ask() -> tuple[bool, str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"tile permission is a Linux x86-64 request, this is {platform.system()}"
    r, err = _arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_long(XFEATURE_XTILEDATA))
    if r != 0:
        return False, (f"Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM) "
                       f"failed: {os.strerror(err)}; Linux 5.16 or newer is needed, and no "
                       "sandbox filtering arch_prctl)")
    mask = ctypes.c_uint64(0)
    r, err = _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
    if r != 0 or not mask.value >> XFEATURE_XTILEDATA & 1:
        return False, "Linux accepted the AMX request but does not report the tile state as " \
            "permitted"
    return True, ""


def granted() -> bool:
    """Ask (once per process) for the tile state; True when tile kernels may run."""
    if not _answer:
        with _lock:
            if not _answer:
                _answer.append(_ask())
    return _answer[0][0]


def refusal() -> str:
    """Why tile kernels do not run ("" when they may, or when nobody asked yet)."""
    return _answer[0][1] if _answer else ""


def _forget() -> None:
    """Tests: ask again on the next call (e.g. with ``_arch_prctl`` replaced)."""
    _answer.clear()
