"""The CPU that kernels are compiled for.

The target is never part of a kernel spec: the same spec compiles to different code on different
CPUs, and the cache key carries the target. ``KWKER_CPU`` / ``KWKER_FEATURES`` override the host
(as numba's NUMBA_CPU_NAME does) so tests can emit AVX-512 code on an AVX2 machine and a fleet
can be prewarmed for another CPU type.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import llvmlite.binding as llvm


@dataclass(frozen=True)
class Target:
    triple: str
    cpu: str
    features: str  # LLVM feature string, e.g. "+avx2,+fma,-avx512f"
    opt_level: int = 3

    def has(self, feature: str) -> bool:
        return f"+{feature}" in self.features.split(",")

    @property
    def vector_bits(self) -> int:
        """Widest vector register the kernels may use."""
        if self.has("avx512f") and self.has("avx512bw") and self.has("avx512vl"):
            return 512
        if self.has("avx2"):
            return 256
        return 128

    def describe(self) -> str:
        isa = {512: "AVX-512", 256: "AVX2", 128: "SSE"}[self.vector_bits]
        return f"{self.cpu} ({isa}{', FMA' if self.has('fma') else ''})"


_INTERESTING = ("sse4.2", "avx", "avx2", "fma", "bmi", "bmi2", "popcnt", "lzcnt", "f16c",
                "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vbmi",
                "avx512vbmi2", "avx512vpopcntdq", "avx512bf16", "avx512fp16")


@functools.lru_cache(maxsize=None)
def host_target() -> Target:
    """Host CPU name and features from LLVM, unless overridden by the environment."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    cpu = os.environ.get("KWKER_CPU") or llvm.get_host_cpu_name()
    features = os.environ.get("KWKER_FEATURES")
    if not features:
        if os.environ.get("KWKER_CPU"):
            features = ""  # a named CPU implies its own features
        else:
            host = llvm.get_host_cpu_features()
            features = ",".join(("+" if host.get(f) else "-") + f for f in _INTERESTING if f in host)
    return Target(llvm.get_process_triple(), cpu, features)


def make_target(cpu: str, features: str) -> Target:
    """A target for another CPU (cross-prewarming, tests of the AVX-512 path)."""
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return Target(llvm.get_process_triple(), cpu, features)
