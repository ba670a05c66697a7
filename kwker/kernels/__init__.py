"""Kernel factories: build (or load) a specialised kernel once, return a cheap callable.

The torch.compile backend codes against these names; each raises ``NotImplementedError`` for
inputs it does not cover (other dtypes), so the caller can keep ATen for them.
"""
from .eltwise import make_eltwise, make_gelu
from .linear import make_linear
from .matmul import make_matmul
from .norm import make_layer_norm
from .sdpa import make_sdpa
from .topk import make_linear_topk

__all__ = ["make_eltwise", "make_gelu", "make_layer_norm", "make_linear", "make_linear_topk",
           "make_matmul", "make_sdpa"]
