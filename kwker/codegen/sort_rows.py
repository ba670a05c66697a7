"""One sorting op's row function: arguments, order-preserving keys, scratch arrays, outputs.

Keys: every op except ``mode`` works on order-preserving signed integer keys. Floats map
``-0.0 -> +0.0`` and every NaN to INT_MAX (so NaNs are equivalent and after +inf, as ATen's
NaN-aware comparators have it), then to two's-complement order; narrow integers widen to i32;
``descending`` complements the key, which turns ATen's DESC comparator (NaN first) into ascending
``<``. Output values are always re-read from the input through the index, so NaN payloads and the
sign of zero are the input's own. ``mode`` uses ATen's plain, not NaN-aware, ``<`` on raw values.

Layout: argument slots (after the common four of rows.py) are listed in ``SLOTS``; scratch per
thread holds the key and index arrays (and the radix sort's second buffers and histograms, or the
quantile selection's bucket starts).
"""
from __future__ import annotations

from llvmlite import ir

from . import simd
from .irutil import (
    DTYPES,
    HALF_FLOATS,
    Fn,
    const,
    f32,
    f64,
    i1,
    i16,
    i32,
    i64,
    intrinsic,
    ptr,
    vec,
    void,
)
from .rows import FIRST_OP_SLOT
from .sort_presorted import TIED
from .sortalgo import SortAlgos, radix_hist_bytes

SLOTS = {name: FIRST_OP_SLOT + i for i, name in enumerate(
    ("src", "in_rs", "n", "out_v", "out_v_rs", "out_v_es", "out_i", "out_i_rs", "out_i_es",
     "p0", "p1", "p2", "p3"))}
NARG = FIRST_OP_SLOT + len(SLOTS)
# bytes before and after each scratch array: stopper masks may read 64 keys past the end
PAD = 512
INDEX_MASK = TIED - 1  # a packed word's index, without the tie flag
SELECT_BUCKETS = 2048  # quantile selection buckets: the top 11 bits of the unsigned key


def key_type(dtype: str) -> ir.IntType:
    return i64 if dtype in ("float64", "int64") else i32


def hist_bytes(kt: ir.IntType) -> int:
    """Counters for the radix sort, or the quantile selection's bucket starts and cursors."""
    return max(radix_hist_bytes(kt), 2 * (SELECT_BUCKETS + 1) * 8)  # starts and cursors


def _align(nbytes: int) -> int:
    return (nbytes + 63) // 64 * 64


def packed_sort(op: str, dtype: str) -> bool:
    """Whether the op's rows are radix-sorted as packed (key << 32 | index) words: sorts of
    32-bit keys (unstable ones then run introsort only where keys tie, sort_presorted.py)."""
    return op == "sort" and key_type(dtype) == i32


def scratch_layout(op: str, dtype: str, n: int, stable: bool = False) -> dict[str, int]:
    """Byte offsets of the per-thread scratch arrays, and the total under ``"size"``."""
    kb = key_type(dtype).width // 8
    sizes = [("K", n * kb), ("I", n * 4)]
    if stable or op in ("quantile", "nanquantile", "kthvalue", "median", "nanmedian") or \
            packed_sort(op, dtype):
        sizes += [("K2", n * kb), ("I2", n * 4), ("H", hist_bytes(key_type(dtype)))]
    if packed_sort(op, dtype):  # K and I hold P, a radix buffer (the second is W or S)
        sizes += [("W", n * 8), ("S", n * 8)]
    out, pos = {}, 0
    for name, size in sizes:
        out[name] = pos + PAD
        pos += _align(size + 2 * PAD)
    out["size"] = pos
    return out


class RowKernel:
    """Shared pieces of one op's row function: arguments, keys, outputs."""

    def __init__(self, module: ir.Module, spec, target):
        self.m, self.spec = module, spec
        self.vt, self.is_float, self.signed = DTYPES[spec.dtype]
        self.kt = key_type(spec.dtype)
        self.f = f = Fn(module, f"{spec.symbol}.row", void, [ptr, i64, ptr],
                        ["args", "row", "scratch"])
        self.args, self.row, self.scratch = f.args
        b = f.b
        self.a = {name: (f.arg_ptr(self.args, s) if name in ("src", "out_v", "out_i")
                         else f.arg_i64(self.args, s)) for name, s in SLOTS.items()}
        self.n = self.a["n"]
        self.src = f.gep(self.a["src"], b.mul(self.row, self.a["in_rs"]), self.vt)
        lanes = max(target.vector_bits // self.kt.width, 4)
        self.lanes = min(lanes, 16)
        self.vector_bits = target.vector_bits
        self._algos: dict[tuple, SortAlgos] = {}

    def lt(self, b, x, y):
        return b.icmp_signed("<", x, y)

    def algos(self, lanes: int | None = None, packed: bool = False,
              presorted: bool = False) -> SortAlgos:
        """The exact algorithms on this op's keys (one set per module and variant)."""
        lanes = self.lanes if lanes is None else lanes
        if packed:
            lanes = max(lanes // 2, 4)  # i64 words per vector
        key = (lanes, packed, presorted)
        if key not in self._algos:
            name = f"{self.spec.symbol}.algo{lanes}{'p' * packed}{'s' * presorted}"
            self._algos[key] = SortAlgos(self.m, self.kt, self.lt, name, vector_lanes=lanes,
                                         packed=packed, presorted=presorted,
                                         vector_bits=self.vector_bits)
        return self._algos[key]

    def fill_packed(self, P):
        """P[j] = (key(src[j]) << 32) | j: one word per element for 32-bit keys. Returns the
        bits in which the keys differ, shifted as in the words (for the radix sort's digits)."""
        f, b = self.f, self.f.b
        W = self.lanes   # keys a step (LLVM vectorised the scalar loop 4 floats a step)
        vt = vec(i64, W)
        both = f.var(vt, ir.Constant(vt, [-1] * W), "kandv")
        either = f.var(vt, ir.Constant(vt, [0] * W), "korv")
        full = b.and_(self.n, const(i64, -W))
        with f.for_range(const(i64, 0), full, step=W, name="fillv") as j:
            k = self.key(f.load_vec(self.vt, W, self.src, j))
            k = b.shl(b.sext(k, vt), ir.Constant(vt, [32] * W))
            at = b.add(simd.broadcast(b, j, W), ir.Constant(vt, list(range(W))))
            b.store(b.or_(k, at), f.gep(P, j, i64), align=8)
            both.set(b.and_(both.get(), k))
            either.set(b.or_(either.get(), k))
        reduce = {op: intrinsic(self.m, f"llvm.vector.reduce.{op}.v{W}i64", i64, [vt])
                  for op in ("and", "or")}
        both_s = f.var(i64, b.call(reduce["and"], [both.get()]), "kand")
        either_s = f.var(i64, b.call(reduce["or"], [either.get()]), "kor")
        with f.for_range(full, self.n, name="fillp") as j:
            k = b.shl(b.sext(self.key(f.load(self.vt, self.src, j)), i64), const(i64, 32))
            f.store(b.or_(k, j), P, j)
            both_s.set(b.and_(both_s.get(), k))
            either_s.set(b.or_(either_s.get(), k))
        return b.xor(both_s.get(), either_s.get())

    def write_packed(self, P, count):
        """Values and indices of the packed words (their index half, without the tie flag of
        sort_presorted.py). A value is its key undone where the key keeps it: not a zero's sign
        nor a NaN's payload, which are gathered from the row (``_unkeyed``)."""
        b, mask = self.f.b, INDEX_MASK

        def keys(j, W):
            words = self.f.load_vec(i64, W, P, j)
            return b.trunc(b.lshr(words, ir.Constant(vec(i64, W), [32] * W)), vec(i32, W))
        self._write_indexed(count, lambda j, W: b.and_(
            self.f.load_vec(i64, W, P, j), ir.Constant(vec(i64, W), [mask] * W)),
            lambda j: b.and_(self.f.load(i64, P, j), const(i64, mask)),
            lambda j, W: self._unkeyed(keys(j, W), W))

    def write_sorted(self, I, count, K=None):
        """Values and indices of the i32 index array ``I``; ``K``: their keys, in the same
        order, from which the values are undone as ``write_packed`` does."""
        b = self.f.b
        values = None if K is None else \
            (lambda j, W: self._unkeyed(self.f.load_vec(self.kt, W, K, j), W))
        self._write_indexed(count, lambda j, W: b.zext(self.f.load_vec(i32, W, I, j),
                                                       vec(i64, W)),
                            lambda j: b.sext(self.f.load(i32, I, j), i64), values)

    def _unkeyed(self, k, W: int):
        """(values, whether any lane must be gathered from the row after all) of W keys
        (``key``'s inverse): a float key drops a zero's sign (both zeros key 0) and a NaN's
        payload (every NaN keys the largest key)."""
        b, kt = self.f.b, self.kt

        def c(x):
            return ir.Constant(vec(kt, W), [x] * W)
        if self.spec.descending:
            k = b.xor(k, c(-1))
        if not self.is_float:
            return k, const(i1, 0)
        maxpos = (1 << (kt.width - 1)) - 1
        special = b.or_(b.icmp_signed("==", k, c(0)), b.icmp_signed("==", k, c(maxpos)))
        bits = b.xor(k, b.and_(b.ashr(k, c(kt.width - 1)), c(maxpos)))
        anyone = b.icmp_unsigned("!=", b.bitcast(special, ir.IntType(W)), const(ir.IntType(W), 0))
        return b.bitcast(bits, vec(self.vt, W)), anyone

    def _write_indexed(self, count, indices, index, values=None):
        """Output slots 0..count-1 from the indices ``indices(j, W)`` (W at a time: 16 when both
        outputs are contiguous along the row) or ``index(j)`` (one); ``values(j, W)``: the W
        values without a gather, and whether they must be gathered after all."""
        f, b = self.f, self.f.b
        start = const(i64, 0)
        W = 16
        if self.lanes >= 8 and self.vt in (f32, i32) and not (
                self.spec.op == "topk" and self.spec.dtype == "bfloat16"):
            full, out_v, out_i = self._whole_vectors(count, W)
            vt = vec(self.vt, W)
            gname = f"llvm.masked.gather.v{W}{'f32' if self.vt == f32 else 'i32'}.v{W}p0"
            gather = intrinsic(self.m, gname, vt, [vec(ptr, W), i32, vec(i1, W), vt])
            keyed = values is not None and self.kt == i32   # (vt is f32 or i32 here)
            with f.for_range(const(i64, 0), full, step=W, name="outv") as j:
                idx = indices(j, W)

                def gathered():
                    ptrs = b.gep(self.src, [idx], inbounds=True, source_etype=self.vt)
                    ptrs.type = vec(ptr, W)  # llvmlite types a vector GEP as a scalar pointer
                    v = b.call(gather, [ptrs, const(i32, 4), ir.Constant(vec(i1, W), [1] * W),
                                        ir.Constant(vt, None)])
                    b.store(v, f.gep(out_v, j, self.vt), align=4)
                if keyed:
                    v, gather_them = values(j, W)
                    with f.if_else(gather_them) as (special, plain):
                        with special:
                            gathered()
                        with plain:
                            b.store(v, f.gep(out_v, j, self.vt), align=4)
                else:
                    gathered()
                b.store(idx, f.gep(out_i, j, i64), align=8)
            start = full
        elif values is not None and self.lanes >= 8 and self.vt in (f64, i64) and \
                self.kt == i64:
            start = self._write_keyed64(count, indices, index, values)
        with f.for_range(start, count, name="outp") as j:
            self.write(j, index(j))

    def _whole_vectors(self, count, W: int) -> tuple:
        """(slots written W at a time: whole vectors of ``count`` where both outputs are
        contiguous along the row, else none; this row's values; its indices)."""
        f, b, a = self.f, self.f.b, self.a
        one = const(i64, 1)
        dense = b.and_(b.icmp_signed("==", a["out_v_es"], one),
                       b.icmp_signed("==", a["out_i_es"], one))
        full = b.select(dense, b.and_(count, const(i64, -W)), const(i64, 0))
        return (full, f.gep(a["out_v"], b.mul(self.row, a["out_v_rs"]), self.vt),
                f.gep(a["out_i"], b.mul(self.row, a["out_i_rs"]), i64))

    def _write_keyed64(self, count, indices, index, values):
        """Float64 / int64 output slots 8 at a time from their keys (a vector with a zero or a
        NaN slot by slot, from the row); returns where the remaining slots start."""
        f, b, W = self.f, self.f.b, 8
        full, out_v, out_i = self._whole_vectors(count, W)
        with f.for_range(const(i64, 0), full, step=W, name="outk") as j:
            v, special = values(j, W)
            with f.if_else(special) as (slow, fast):
                with slow:
                    with f.for_range(j, b.add(j, const(i64, W)), name="outs") as jj:
                        self.write(jj, index(jj))
                with fast:
                    b.store(v, f.gep(out_v, j, self.vt), align=8)
                    b.store(indices(j, W), f.gep(out_i, j, i64), align=8)
        return full

    def scratch_arrays(self, names):
        """Pointers to the scratch arrays: offsets computed at run time from n."""
        b, kb = self.f.b, self.kt.width // 8
        sizes = {"K": b.mul(self.n, const(i64, kb)), "I": b.mul(self.n, const(i64, 4)),
                 "P": b.mul(self.n, const(i64, 8))}
        pad = const(i64, PAD)
        if names == ["P"]:  # P spans the K and I regions of scratch_layout
            return [self.f.gep(self.scratch, pad, ir.IntType(8))]
        sizes["K2"], sizes["I2"] = sizes["K"], sizes["I"]
        sizes["H"] = const(i64, hist_bytes(self.kt))
        sizes["W"] = sizes["S"] = sizes["P"]
        out, pos = {}, const(i64, 0)
        for name in ("K", "I", "K2", "I2", "H", "W", "S"):
            out[name] = self.f.gep(self.scratch, b.add(pos, pad), ir.IntType(8))
            size = b.add(sizes[name], const(i64, 2 * PAD + 63))
            pos = b.add(pos, b.and_(size, const(i64, ~63)))
            if name == names[-1]:
                break
        return [out[nm] for nm in names]

    # ------------------------------------------------------------------ keys
    def as_float(self, v):
        """A stored value as a float: float16/bfloat16 bits widen exactly to float32, which is
        how ATen compares them."""
        if self.spec.dtype not in HALF_FLOATS:
            return v
        b = self.f.b
        lanes = v.type.count if isinstance(v.type, ir.VectorType) else None
        if self.spec.dtype == "float16":
            return b.fpext(b.bitcast(v, vec(ir.HalfType(), lanes) if lanes else ir.HalfType()),
                           vec(f32, lanes) if lanes else f32)
        wide = b.zext(v, vec(i32, lanes) if lanes else i32)
        wide = b.shl(wide, ir.Constant(vec(i32, lanes), [16] * lanes) if lanes else const(i32, 16))
        return b.bitcast(wide, vec(f32, lanes) if lanes else f32)

    def key(self, v, descending=None):
        """Order-preserving signed integer key of a value (scalar or vector)."""
        b = self.f.b
        desc = self.spec.descending if descending is None else descending
        if self.is_float:
            v = self.as_float(v)
        vty = v.type
        lanes = vty.count if isinstance(vty, ir.VectorType) else None

        def c(ty, x):
            return ir.Constant(vec(ty, lanes), [x] * lanes) if lanes else const(ty, x)
        kt = self.kt
        if self.is_float:
            ity = vec(kt, lanes) if lanes else kt
            bits = b.bitcast(v, ity)
            zero = b.fcmp_ordered("==", v, c(vty.element if lanes else vty, 0.0))
            bits = b.select(zero, c(kt, 0), bits)
            maxpos = (1 << (kt.width - 1)) - 1
            k = b.xor(bits, b.and_(b.ashr(bits, c(kt, kt.width - 1)), c(kt, maxpos)))
            k = b.select(b.fcmp_unordered("uno", v, v), c(kt, maxpos), k)
        elif self.vt.width < kt.width:
            ity = vec(kt, lanes) if lanes else kt
            k = b.sext(v, ity) if self.signed else b.zext(v, ity)
        else:
            k = v
        if desc:
            k = b.xor(k, c(kt, -1))
        return k

    def nan_key(self):
        return const(self.kt, (1 << (self.kt.width - 1)) - 1)

    def fill_keys(self, K, I, count_nan=False, varying=False):
        """K[j] = key(src[j]), I[j] = j; returns the NaN count when asked (floats), or with
        ``varying`` the bits in which the keys differ (for the radix sort's digits)."""
        f, b = self.f, self.f.b
        nnan = f.var(i64, const(i64, 0), "nnan")
        kt = self.kt
        both, either = f.var(kt, const(kt, -1), "kand"), f.var(kt, const(kt, 0), "kor")
        with f.for_range(const(i64, 0), self.n, name="fill") as j:
            k = self.key(f.load(self.vt, self.src, j))
            f.store(k, K, j)
            f.store(b.trunc(j, i32), I, j)
            if count_nan and self.is_float:
                isn = b.icmp_signed("==", k, self.nan_key())
                nnan.set(b.add(nnan.get(), b.zext(isn, i64)))
            if varying:
                both.set(b.and_(both.get(), k))
                either.set(b.or_(either.get(), k))
        return b.xor(both.get(), either.get()) if varying else nnan.get()

    # ------------------------------------------------------------------ outputs
    def write(self, j, idx):
        """Output slot ``j`` of this row gets src[idx] and idx."""
        f, b, a = self.f, self.f.b, self.a
        vpos = b.add(b.mul(self.row, a["out_v_rs"]), b.mul(j, a["out_v_es"]))
        v = f.load(self.vt, self.src, idx)
        if self.spec.op == "topk" and self.spec.dtype == "bfloat16":
            # ATen's bfloat16 topk round-trips values through float32, which makes NaNs canonical
            v = b.select(b.fcmp_unordered("uno", self.as_float(v), self.as_float(v)),
                         const(i16, 0x7FC0), v)
        f.store(v, a["out_v"], vpos)
        ipos = b.add(b.mul(self.row, a["out_i_rs"]), b.mul(j, a["out_i_es"]))
        f.store(idx, a["out_i"], ipos)

    def finish(self):
        self.f.finish()
        return self.f.fn
