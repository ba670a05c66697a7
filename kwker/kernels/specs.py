"""Specs of the compute-kernel families (GEMM, elementwise, attention, fused top-k).

A spec holds every choice that changes the emitted code: shapes, flags and the blocking the
factory picked for this CPU (so two CPUs with different caches get different specs, and the
packed weight layout always matches the kernel). The ISA comes from the target at emit time.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..spec import Spec, register_spec


@register_spec
@dataclass(frozen=True)
class EltwiseSpec(Spec):
    """``out = op(x)`` over ``numel`` contiguous float32 (op: gelu, gelu_tanh, relu, exp, ...)."""
    op: str
    numel: int
    family = "eltwise"


@register_spec
@dataclass(frozen=True)
class GemmSpec(Spec):
    """``C = act(A @ B + bias) + residual`` for fixed shapes and blocking (see codegen/gemm.py).

    ``b_layout``: ``packed`` (weights pre-packed into ``nr``-wide panels by the factory), ``kn``
    (runtime row-major B) or ``nk`` (runtime B given transposed). ``a_pack=False`` is the
    small-M schedule (no packing, ``mr == m``, K unblocked).
    """
    m: int
    n: int
    k: int
    batch: int = 1
    b_layout: str = "packed"
    bias: bool = False
    epilogue: str = "none"
    residual: bool = False
    mr: int = 12
    nr: int = 32
    kc: int = 256
    mc: int = 252
    nb: int = 16
    a_pack: bool = True
    ksplit: int = 1
    unroll: int = 1
    family = "gemm"

    @property
    def symbol(self) -> str:
        flags = (("_bias" if self.bias else "") + ("" if self.epilogue == "none" else
                 "_" + self.epilogue) + ("_res" if self.residual else ""))
        return (f"kw_gemm_{self.m}x{self.n}x{self.k}_b{self.batch}_{self.b_layout}{flags}"
                f"_t{self.mr}x{self.nr}_kc{self.kc}_mc{self.mc}_nb{self.nb}"
                f"_p{int(self.a_pack)}_s{self.ksplit}_u{self.unroll}")
