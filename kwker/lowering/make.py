"""Kernel factories by name, and the specs of every kernel a lowering builds.

The builders (build.py, build_attention.py) ask for a factory of ``kwker.kernels`` by name, so
a kernel family that is missing leaves its nodes to ATen with that reason; every spec a factory
returns is collected for the report, the dump and packages.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
from pathlib import Path

from ..runtime import kernel
from ..runtime.collect import Collector
from ..runtime.target import host_target

_factories: dict[str, object] = {}


def factory(name: str):
    """``kwker.kernels.<name>``, looked up in the package and then its modules; None if absent."""
    if name in _factories:
        return _factories[name]
    fn = None
    try:
        pkg = importlib.import_module("kwker.kernels")
        fn = getattr(pkg, name, None)
        if fn is None:
            for info in pkgutil.iter_modules(pkg.__path__):
                mod = importlib.import_module(f"kwker.kernels.{info.name}")
                fn = getattr(mod, name, None)
                if fn is not None:
                    break
    except ImportError:
        fn = None
    _factories[name] = fn
    return fn


def known(*dims) -> bool:
    """Whether every size is a plain int (else the kernel is built generic over it)."""
    return all(type(d) is int for d in dims)


def generic(fn) -> bool:
    """Whether a built callable serves every size of its varying dims (for the report)."""
    return bool(getattr(fn, "kwker_generic", False))


def mark_generic(fn, is_generic: bool):
    if fn is not None:
        fn.kwker_generic = is_generic
    return fn


_built = Collector()


@contextlib.contextmanager
def collecting(dump_dir=None):
    """Yield the list of specs of every kernel built inside; dump their IR and assembly.

    The runtime dumps only what it compiles; kernels already in the object cache are emitted
    again here, so ``dump_dir`` always receives every kernel the graph uses.
    """
    with _built.collecting() as specs:
        yield specs
    if dump_dir:
        target = host_target()
        for spec in dict.fromkeys(specs):
            kernel.dump(spec, target, kernel.ir_text(spec, target), Path(dump_dir))


def discard(fn) -> None:
    """Take back the specs of a kernel built but not used (ATen measured faster), so the
    report does not list them."""
    specs = _built.active()
    for s in getattr(fn, "kwker_specs", ()) if specs is not None else ():
        if s in specs:
            specs.remove(s)


def make_kernel(name: str, *args, **kwargs):
    """(callable, None) from the factory ``name``, its specs collected; or (None, why) when the
    factory is missing or raises ``NotImplementedError`` (the nodes then stay on ATen)."""
    f = factory(name)
    if f is None:
        return None, f"kwker.kernels.{name} does not exist yet"
    try:
        fn = f(*args, **kwargs)
    except NotImplementedError as e:
        return None, f"{name}: {e}"
    for attr in ("spec", "specs"):
        v = getattr(fn, attr, None)
        for spec in v if isinstance(v, (list, tuple)) else [v] if v is not None else []:
            _built.add(spec)
    return fn, None
