"""How far ahead the low-bit decode kernels prefetch their weight streams: measured per machine.

A decode token reads every weight once, from memory. Whether a software prefetch ahead of each
thread's stream helps depends on the CPU, not on the layer: on an Emerald Rapids-class Xeon the
hardware prefetchers alone left the reads waiting (int4 GPT-2's 49 GEMVs, 2 threads: 6.1-6.6 ms
without, 3.7-3.8 ms with 4 KB ahead), while on Zen 4 the prefetches slowed the same streams
(int8 5.7 -> 4.7 ms and int4 3.9 -> 3.3 ms without them, one process, alternating; probably
the requests they add, issued from L1, compete with the L2 prefetcher's).

So the choice is measured once per CPU type and bit width, through the tuner like every variant
(``variants.winner``): one decode kernel of each candidate on a synthetic weight twice the L3's
size and at least 128 MB (a Zen 4 KVM guest reporting 32 MB of L3 read 77 MB at 79-83 GB/s, its
memory at 54), so every timed call streams from memory as a token's linears do (a kernel timed on
one layer's weights, as the per-problem variants are, reads them from cache after its first
call). Where nothing is measured (``KWKER_TUNE=off``, a named target) or on AVX2 (whose streams
are prefetched non-temporally to keep the other ops' data cached, gemm_lowbit.py) the default
holds: ``simd.STREAM_AHEAD``.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from ..codegen import simd
from ..runtime import tuning
from ..runtime.target import host_target
from . import variants

NONE = 0
K = 768                     # the probe's row length (GPT-2's width)
MIN_BYTES = 128 << 20       # streamed per timed call at least (a VM may not report its L3)
MAX_BYTES = 512 << 20


def ahead(bits: int, build) -> int:
    """Bytes the decode kernels of ``bits``-bit weights prefetch ahead (0: none) here.
    ``build(q, scale, bits, distance)`` makes the factory's decode callable of the weight
    ``q`` (N, K) int8 values with one ``scale`` a row, prefetched ``distance`` bytes ahead."""
    if simd.float_lanes(host_target()) != 16:
        return simd.STREAM_AHEAD
    return _measured(bits, build, tuning.mode(), os.environ.get("KWKER_CACHE_DIR"))


@functools.cache
def _measured(bits: int, build, *memo_key) -> int:
    """Measured or read once a process per bit width (under one tuning mode and cache): a
    timing taken under load is not recorded, but holds for this process."""
    weight: list = []   # one synthetic weight for both: the factory packs it once

    def probe(distance: int):
        """The decode callable (one x row of K) of a ``bits``-bit weight of
        ``_probe_bytes()``, prefetched ``distance`` bytes ahead."""
        if not weight:
            rows = -(-_probe_bytes() * 8 // (bits * K))
            q = torch.ones(rows, K, dtype=torch.int8)
            q[::3] = -2      # not one value: any reading of the weights sees rows that differ
            weight.extend((q, torch.full((rows, 1), 0.01)))
        return build(*weight, bits, distance)

    candidates = {str(a): functools.partial(probe, a) for a in (simd.STREAM_AHEAD, NONE)}
    return int(variants.winner("low-bit weight stream", {"bits": bits}, candidates,
                               lambda: [torch.randn(1, K)]))


def _probe_bytes() -> int:
    """Twice the L3 cache (read from sysfs), within [MIN_BYTES, MAX_BYTES]."""
    size = 0
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        size = int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        pass
    return min(MAX_BYTES, max(MIN_BYTES, 2 * size))
