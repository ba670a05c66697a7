"""Kwker: JIT kernel generator (LLVM IR via llvmlite) that makes PyTorch models faster on x86-64.

``import kwker.torch_ops`` for the eager drop-in sorting kernels; ``torch.compile(model,
backend="kwker")`` for the compiler backend. Importing this package is cheap: torch integration
is loaded only by the modules that need it.
"""
__version__ = "0.1.0"

_PACKAGE_API = ("package", "load_package", "package_specs", "exported_program", "PackageError",
                "PackagedModel")


def __getattr__(name: str):
    """``kwker.package`` / ``kwker.load_package`` (``packaging.py``), imported on first use."""
    if name in _PACKAGE_API:
        from . import packaging
        value = getattr(packaging, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kwker' has no attribute {name!r}")
