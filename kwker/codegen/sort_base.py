"""The element model and constants shared by the exact sorting building blocks.

Elements are structure-of-arrays: a key array ``K`` (keys compare with ``lt``) and an i32 index
array ``I`` that always moves with its key; or, packed, one i64 word per element,
(i32 key << 32) | index, in ``K`` alone. The building blocks (sort_partition, sort_heap,
sort_small, sort_equal) are mixins over this base; sortalgo.py composes them into ``SortAlgos``.
Each block is emitted once per module, as a function named after the set's prefix (``_fn``).
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, intrinsic, ptr, void

THRESHOLD = 16  # libstdc++ _S_threshold
BLOCKS = (64, 16)  # block partition widths: wide while the scans are far apart, then narrow
EQUAL_MIN = 64  # ranges at least this long are checked for all-equal keys (one-pass subtree)
# packed ranges up to this long try a sorting network first (64 beat 32 on AVX-512 and on AVX2
# code, measured on a Zen 4). Not on AVX2 CPUs: 64-bit min/max are compare-and-blend there and
# a 64-word network spills 16 registers, so the partitions it replaces were faster (Zen 3, 16
# rows of 20000 with 65536 distinct values: 12.5 ms with networks of 64, 10.1 with 32, 8.7
# without; random and 4-valued rows alike).
NETWORK_MAX = 64


class SortAlgosBase:
    """Construction and element access for one key type and comparator (see ``SortAlgos``)."""

    def __init__(self, module: ir.Module, key_type: ir.Type, lt, prefix: str,
                 vector_lanes: int = 0, packed: bool = False, presorted: bool = False,
                 vector_bits: int = 0):
        self.m, self.kt, self.lt, self.prefix = module, key_type, lt, prefix
        self.lanes = vector_lanes
        # packed words compressed and expanded a vector at a time (sort_partition.py's
        # one-sided scans): AVX-512 instructions, or AVX2's vpermd from tables; not on SSE
        self.word_permutes = packed and vector_bits >= 256 and vector_lanes in (4, 8)
        # packed: one i64 word per element, (i32 key << 32) | index, in K (I unused): a swap is
        # two loads and two stores instead of four and four
        self.packed = packed
        assert not packed or key_type == i32
        # presorted (packed only): I holds the row sorted, K's tied keys are flagged, and ranges
        # without a flag are copied from I (sort_presorted.py)
        self.presorted = presorted
        assert not presorted or packed
        self.elem_types = [i64] if packed else [key_type, i32]
        # packed words: all-equal ranges of EQUAL_MIN or more take their whole subtree at once,
        # through the context's spare array (sort_presorted.py)
        self.equal_ranges = presorted and vector_lanes >= 4
        # the widest sorting network of packed words, for short rows (sort_full.py) ...
        self.network_max = NETWORK_MAX if packed and vector_lanes >= 4 else 0
        # ... and for introsort's ranges whose keys all differ (``distinct_sort``)
        self.distinct_max = NETWORK_MAX if packed and vector_lanes >= 8 else 0
        self._fns: dict[str, ir.Function] = {}

    # ---------------------------------------------------------------- element helpers
    def _get(self, f: Fn, K, I, i):
        if self.packed:
            return (f.load(i64, K, i),)
        return f.load(self.kt, K, i), f.load(i32, I, i)

    def _put(self, f: Fn, K, I, i, elem):
        if self.packed:
            f.store(elem[0], K, i)
            return
        f.store(elem[0], K, i)
        f.store(elem[1], I, i)

    def key_of(self, b, elem):
        return b.trunc(b.ashr(elem[0], const(i64, 32)), i32) if self.packed else elem[0]

    def key_at(self, f: Fn, K, i):
        return self.key_of(f.b, self._get(f, K, None, i)) if self.packed else \
            f.load(self.kt, K, i)

    def _move(self, f: Fn, K, I, dst, src):
        self._put(f, K, I, dst, self._get(f, K, I, src))

    def swap(self, f: Fn, K, I, a, b):
        ea, eb = self._get(f, K, I, a), self._get(f, K, I, b)
        self._put(f, K, I, a, eb)
        self._put(f, K, I, b, ea)

    def copy_words(self, f: Fn, dst, src, first, last) -> None:
        """dst[first:last] = src[first:last], packed words (one memcpy)."""
        b = f.b
        memcpy = intrinsic(self.m, "llvm.memcpy.p0.p0.i64", void, [ptr, ptr, i64, i1])
        b.call(memcpy, [f.gep(dst, first, i64), f.gep(src, first, i64),
                        b.mul(b.sub(last, first), const(i64, 8)), const(i1, 0)])

    def _fn(self, name: str, ret, args, argnames, body):
        full = f"{self.prefix}.{name}"
        if full not in self._fns:
            f = Fn(self.m, full, ret, args, argnames)
            self._fns[full] = f.fn
            body(f)
            f.finish()
        return self._fns[full]
