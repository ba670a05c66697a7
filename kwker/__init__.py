"""Kwker: JIT kernel generator (LLVM IR via llvmlite) that makes PyTorch models faster on x86-64.

``import kwker.torch_ops`` for the eager drop-in sorting kernels; ``torch.compile(model,
backend="kwker")`` for the compiler backend. Importing this package is cheap: torch integration
is loaded only by the modules that need it.
"""
__version__ = "0.1.0"
