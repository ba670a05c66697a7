"""Sizes and strides of the attention kernel (compile-time, or read at call time: the generic
form), and how its items are split between threads.

An ``AttentionSpec`` with ``batch = lq = lk = 0`` is generic: one kernel per (heads, e, ev, flags,
dtype) serves every batch, query length, key length and layout. Its ABI:

    void sym(q, k, v, mask, out, strides, i64 batch, i64 lq, i64 lk, i64 nthreads)

``strides`` points at the 4-D element strides of q, k, v and out, then of the mask (0 on its
broadcast dims) if there is one: 16 or 20 i64. The last stride of every operand is 1 (the mask's
too unless its key dim is broadcast). The sizes are i64 arguments as in every generic kernel;
the strides travel in one table because each ctypes argument costs 0.05-0.1 us: 20 more would
add 1-2 us to a decode step of ~5 us.

The generic kernel holds both schedules (few queries: dot products; else the blocked one) and
picks one by ``lq``. The micro-kernels and packing helpers take compile-time row strides, so an
operand whose rows are not ``e`` (``ev``) elements apart is first copied into scratch where they
are (a per-call check; the decode path reads Q and K in place with the runtime strides).
"""
from __future__ import annotations

from dataclasses import dataclass

from llvmlite import ir

from . import omp
from .irutil import Fn, const, defined, i1, i8, i64, intrinsic, ptr, void

ARGS = [ptr] * 6 + [i64] * 3        # q, k, v, mask, out, strides table, batch, lq, lk
SLOT_TABLE, SLOT_BATCH, SLOT_LQ, SLOT_LK = 5, 6, 7, 8


DIRECT_MAX_LQ = 4  # packing K costs ~0.4 op per element, more than a few dot products save
# A thread is worth its fork for ~2.5 us of work: 2**18 flops of FMAs, or 2**15 bytes of K and V
# read from L3 or memory. The bytes decide a decoder's step (one query row: few flops, a whole
# KV cache to read): GPT-2's 12 heads x 160 keys ran on one thread in 86-98 us when the weights
# just streamed had evicted the cache, against ATen's 57-63 on two.
FLOPS_PER_THREAD, KV_BYTES_PER_THREAD = 18, 15


def kv_bytes_per_key(s) -> int:
    """Bytes of K and V per key position, over all kv heads of one batch entry."""
    return (s.kv_heads or s.heads) * (s.e + s.ev) * (2 if s.dtype == "bf16" else 4)


def thread_cap(flops: int, kv_bytes: int) -> int:
    """Threads the work pays for (static kernels; the generic one computes the same in IR)."""
    return max(flops >> FLOPS_PER_THREAD, kv_bytes >> KV_BYTES_PER_THREAD)


@dataclass
class Dims:
    """Sizes and (batch, head, row) element strides, as ints or i64 values of one call."""
    batch: object
    lq: object
    lk: object
    nqb: object           # blocks of bq query rows
    qs: tuple
    ks: tuple
    vs: tuple
    os: tuple
    ms: tuple | None      # mask strides (batch, head, row); None without a mask


def static_dims(s, kvh: int) -> Dims:
    """Compile-time sizes; strides from ``s.strides`` or contiguous."""
    qs, ks, vs, os = s.strides or (
        (s.heads * s.lq * s.e, s.lq * s.e, s.e), (kvh * s.lk * s.e, s.lk * s.e, s.e),
        (kvh * s.lk * s.ev, s.lk * s.ev, s.ev), (s.heads * s.lq * s.ev, s.lq * s.ev, s.ev))
    ms = None
    if s.mask != "none":
        _, mh, mq, mk = s.mask_shape
        ms = (mh * mq * mk, mq * mk, mk)
    return Dims(s.batch, s.lq, s.lk, -(-s.lq // s.bq), qs, ks, vs, os, ms)


def load_dims(f: Fn, ctx: omp.Context, s) -> Dims:
    """The call's sizes from the arguments and strides from the table (generic kernel)."""
    table = ctx.ptr(SLOT_TABLE)
    strides = [tuple(f.load(i64, table, const(i64, 4 * t + d)) for d in range(3))
               for t in range(5 if s.mask != "none" else 4)]
    lq = ctx.i64(SLOT_LQ)
    return Dims(ctx.i64(SLOT_BATCH), lq, ctx.i64(SLOT_LK), icdiv(f.b, lq, s.bq), *strides[:4],
                strides[4] if len(strides) > 4 else None)


def imul(b: ir.IRBuilder, *xs):
    """Product of ints and i64 values; an int when all are ints (no instructions emitted)."""
    k, vals = 1, []
    for x in xs:
        if isinstance(x, ir.Value):
            vals.append(x)
        else:
            k *= x
    if not vals or k == 0:
        return k
    out = vals[0]
    for v in vals[1:] + ([const(i64, k)] if k != 1 else []):
        out = b.mul(out, v)
    return out


def iadd(b: ir.IRBuilder, x, y):
    if isinstance(x, ir.Value) or isinstance(y, ir.Value):
        return b.add(x if isinstance(x, ir.Value) else const(i64, x),
                     y if isinstance(y, ir.Value) else const(i64, y))
    return x + y


def icdiv(b: ir.IRBuilder, x, n: int):
    """``ceil(x / n)`` of an int or i64 value."""
    if not isinstance(x, ir.Value):
        return -(-x // n)
    return b.sdiv(b.add(x, const(i64, n - 1)), const(i64, n))


def round_up(b: ir.IRBuilder, x, n: int):
    """``x`` rounded up to a multiple of ``n``."""
    return imul(b, icdiv(b, x, n), n)


def align64(b: ir.IRBuilder, raw: ir.Value) -> ir.Value:
    addr = b.ptrtoint(raw, i64)
    pad = b.and_(b.sub(const(i64, 64), b.and_(addr, const(i64, 63))), const(i64, 63))
    return b.gep(raw, [pad], inbounds=True, source_etype=i8)


def scratch(f: Fn, malloc: ir.Function, sizes: list) -> tuple[list, list]:
    """The generic kernel's scratch buffers (``sizes`` in 4-byte words) carved from one malloc
    (one pair of calls per thread and call, not eight): ([raw pointer], 64-byte aligned parts)."""
    b, offsets = f.b, [0]
    for n in sizes:
        offsets.append(iadd(b, offsets[-1], round_up(b, imul(b, n, 4), 64)))
    raw = b.call(malloc, [f.i64(iadd(b, offsets[-1], 64))])
    base = align64(b, raw)
    return [raw], [f.gep(base, f.i64(o), i8) for o in offsets[:-1]]


def emit_copy_rows(module: ir.Module, cols: int, size: int) -> ir.Function:
    """``void copy_rows(ptr src, i64 rows, i64 ld, ptr dst)``: ``rows`` rows of ``cols``
    elements of ``size`` bytes from row stride ``ld`` to row stride ``cols``."""
    name = f"copy_rows.{cols}.{size}"
    existing = defined(module, name)
    if existing is not None:
        return existing
    f = Fn(module, name, void, [ptr, i64, i64, ptr], ["src", "rows", "ld", "dst"])
    f.fn.attributes.add("noinline")
    src, rows, ld, dst = f.args
    b = f.b
    memcpy = intrinsic(module, "llvm.memcpy.p0.p0.i64", void, [ptr, ptr, i64, i1])
    with f.for_range(0, rows, name="r") as r:
        d = f.gep(dst, b.mul(r, const(i64, cols * size)), i8)
        s = f.gep(src, b.mul(b.mul(r, ld), const(i64, size)), i8)
        b.call(memcpy, [d, s, const(i64, cols * size), ir.Constant(i1, 0)])
    return f.finish()


def emit_generic(module: ir.Module, s, direct: ir.Function, blocked: ir.Function,
                 direct_max_lq: int) -> None:
    """Export the generic kernel: the body picks the schedule by lq; the team is capped as the
    static kernel's is at compile time (``thread_cap``, no more than work items)."""
    f = omp.body_fn(module, f"{s.symbol}.body")
    b = f.b
    lq = omp.Context(f, f.args[0]).i64(SLOT_LQ)
    with f.if_else(b.icmp_signed("<=", lq, const(i64, direct_max_lq))) as (few, many):
        with few:
            b.call(direct, list(f.args))
        with many:
            b.call(blocked, list(f.args))

    def max_threads(b: ir.IRBuilder, args) -> ir.Value:
        batch, lq, lk = args[SLOT_BATCH:SLOT_LK + 1]
        heads = b.mul(batch, const(i64, s.heads))
        flops = b.mul(b.mul(heads, b.mul(lq, lk)), const(i64, 4 * max(s.e, s.ev)))
        kv = b.mul(b.mul(batch, lk), const(i64, kv_bytes_per_key(s)))
        items = b.mul(heads, icdiv(b, lq, s.bq))
        by_flops = b.ashr(flops, const(i64, FLOPS_PER_THREAD))
        by_bytes = b.ashr(kv, const(i64, KV_BYTES_PER_THREAD))
        cap = b.select(b.icmp_signed(">", by_flops, by_bytes), by_flops, by_bytes)
        return b.select(b.icmp_signed("<", items, cap), items, cap)

    omp.emit_parallel(module, s.symbol, ARGS, f.finish(), max_threads=max_threads)


def thread_items(f: Fn, heads, nqb, tid, nt) -> tuple:
    """(first item, end, stride) of thread ``tid``'s items (item = head * nqb + query block;
    ``heads`` counts batch x heads). Whole heads, a contiguous range each, when there are enough
    to balance (at least 4 per thread, or as many per thread): each thread then packs a head's K
    and V once. Round robin over the items otherwise (few heads: the query blocks of a causal
    head cost more and more, which a contiguous split would give one thread). Measured on the
    encoder layer's (8, 8, 128, 32) bf16 attention: round robin packed every head on both
    threads and ran at 1.48x one thread's speed, whole heads at 1.99x."""
    b = f.b
    heads, nqb = f.i64(heads), f.i64(nqb)
    whole = b.or_(b.icmp_signed(">=", heads, b.mul(nt, const(i64, 4))),
                  b.icmp_signed("==", b.srem(heads, nt), const(i64, 0)))
    first, last = omp.split(f, heads, tid, nt)
    return (b.select(whole, b.mul(first, nqb), tid),
            b.select(whole, b.mul(last, nqb), b.mul(heads, nqb)),
            b.select(whole, const(i64, 1), nt))
