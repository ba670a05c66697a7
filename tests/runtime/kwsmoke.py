"""A tiny kernel family for the cache tests: ``y = 2 * x + n``, one spec (and entry) per ``n``.

Each ``n`` bakes a different constant into the code, so loading the wrong entry gives wrong
numbers. Importing this module registers the family with the spec registry and the kernel
pipeline, as a plugin would.
"""
from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kwker.codegen import irutil as U
from kwker.codegen.rows import FIRST_OP_SLOT, emit_row_driver
from kwker.runtime import kernel, loader
from kwker.runtime.calling import call
from kwker.spec import Spec, register_spec

FAMILY = "cachesmoke"


@register_spec
@dataclass(frozen=True)
class CacheSmokeSpec(Spec):
    n: int
    dtype: str = "float32"
    family = FAMILY


def emit(spec: CacheSmokeSpec, target):
    if spec.n < 0:
        raise ValueError(f"cachesmoke cannot emit n={spec.n}")  # a spec whose compile fails
    m = U.new_module(f"cachesmoke{spec.n}")
    f = U.Fn(m, "row", U.void, [U.ptr, U.i64, U.ptr], ["args", "row", "scratch"])
    args, row, _ = f.args
    src, dst = f.arg_ptr(args, FIRST_OP_SLOT), f.arg_ptr(args, FIRST_OP_SLOT + 1)
    cols = f.arg_i64(args, FIRST_OP_SLOT + 2)
    with f.for_range(0, cols) as j:
        o = f.b.add(f.b.mul(row, cols), j)
        v = f.b.fmul(f.load(U.f32, src, o), U.const(U.f32, 2.0))
        f.store(f.b.fadd(v, U.const(U.f32, float(spec.n))), dst, o)
    f.finish()
    emit_row_driver(m, spec.symbol, f.fn)
    return m


kernel.EMITTERS[FAMILY] = __name__


def _torch_gomp() -> ctypes.CDLL:
    """The libgomp torch ships, found without importing torch (1.5 s per test process)."""
    libdir = Path(importlib.util.find_spec("torch").origin).parent / "lib"
    found = sorted(libdir.glob("libgomp*.so*"))
    return ctypes.CDLL(str(found[0]) if found else "libgomp.so.1", mode=ctypes.RTLD_GLOBAL)


loader._gomp = _torch_gomp


def run(n: int) -> bool:
    """Run spec ``n`` through the whole pipeline and compare with numpy."""
    x = np.random.default_rng(n).standard_normal((8, 100)).astype(np.float32)
    y = np.empty_like(x)
    call(CacheSmokeSpec(n), [1, 8, 0, 0, x.ctypes.data, y.ctypes.data, 100])
    return bool(np.array_equal(y, x * np.float32(2) + np.float32(n)))
