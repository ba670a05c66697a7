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
