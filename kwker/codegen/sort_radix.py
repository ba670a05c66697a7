"""The stable sort: an LSD radix sort on order-preserving integer keys.

Any stable sort gives the one stable order, so no libstdc++ step needs emulating here.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, ptr


def radix_digits(key_type: ir.IntType) -> list[tuple[int, int]]:
    """(shift, bits) of each LSD pass: 11-bit digits for 32-bit keys (three passes, their
    counters fit in L1), bytes for 64-bit keys."""
    width, step = key_type.width, (11 if key_type.width == 32 else 8)
    return [(s, min(step, width - s)) for s in range(0, width, step)]


def radix_hist_bytes(key_type: ir.IntType) -> int:
    return sum(1 << bits for _, bits in radix_digits(key_type)) * 8


def emit_radix_sort(module: ir.Module, key_type: ir.IntType, name: str) -> ir.Function:
    """Stable ascending sort of signed integer keys with their i32 indices (LSD radix).

    ``radix(K, I, K2, I2, hist, n) -> i1``: true when the result ended in (K2, I2). ``hist`` holds
    ``radix_hist_bytes`` of i64 counters. Passes whose digit is the same for every key are
    skipped.
    """
    digits = radix_digits(key_type)
    bases, total = [], 0
    for _, bits in digits:
        bases.append(total)
        total += 1 << bits
    f = Fn(module, name, i1, [ptr, ptr, ptr, ptr, ptr, i64], ["K", "I", "K2", "I2", "H", "n"])
    K, I, K2, I2, H, n = f.args
    b = f.b
    kt = key_type
    sign = const(kt, 1 << (kt.width - 1))
    zero = const(i64, 0)

    def digit(key, p):
        shift, bits = digits[p]
        d = b.and_(b.lshr(b.xor(key, sign), const(kt, shift)), const(kt, (1 << bits) - 1))
        return b.add(b.zext(d, i64) if kt.width < 64 else d, const(i64, bases[p]))
    with f.for_range(0, total, name="z") as z:
        f.store(zero, H, z)
    with f.for_range(zero, n, name="h") as i:
        key = f.load(kt, K, i)
        for p in range(len(digits)):
            slot = digit(key, p)
            f.store(b.add(f.load(i64, H, slot), const(i64, 1)), H, slot)
    src_k, src_i = f.var(ptr, K, "sk"), f.var(ptr, I, "si")
    dst_k, dst_i = f.var(ptr, K2, "dk"), f.var(ptr, I2, "di")
    flipped = f.var(i1, const(i1, 0), "flipped")
    for p, (_, bits) in enumerate(digits):
        # skip a pass whose digit is constant: its bucket holds every key
        d0 = digit(f.load(kt, src_k.get(), zero), p)
        with f.if_(b.icmp_signed("!=", f.load(i64, H, d0), n)):
            run = f.var(i64, zero, "run")
            with f.for_range(bases[p], bases[p] + (1 << bits), name="pre") as slot:
                c = f.load(i64, H, slot)
                f.store(run.get(), H, slot)
                run.set(b.add(run.get(), c))
            sk, si, dk, di = src_k.get(), src_i.get(), dst_k.get(), dst_i.get()
            with f.for_range(zero, n, name="scatter") as i:
                key = f.load(kt, sk, i)
                slot = digit(key, p)
                pos = f.load(i64, H, slot)
                f.store(b.add(pos, const(i64, 1)), H, slot)
                f.store(key, dk, pos)
                f.store(f.load(i32, si, i), di, pos)
            src_k.set(dk)
            src_i.set(di)
            dst_k.set(sk)
            dst_i.set(si)
            flipped.set(b.xor(flipped.get(), const(i1, 1)))
    f.ret(flipped.get())
    return f.finish()


def emit_radix_sort_packed(module: ir.Module, name: str) -> ir.Function:
    """Stable ascending sort of packed (i32 key << 32 | index) words by their key (LSD radix,
    the digits of ``radix_digits(i32)``): one 8-byte store per element and pass, where the
    key/index pair costs two stores to two arrays' cache lines.

    ``radix(src, A, B, hist, n) -> ptr``: the array holding the result, A or B (``src`` itself
    only when every pass is skipped); ``src`` is never written. ``hist`` holds
    ``radix_hist_bytes(i32)`` of i64 counters. Passes whose digit is the same for every key are
    skipped.
    """
    digits = radix_digits(ir.IntType(32))
    bases, total = [], 0
    for _, bits in digits:
        bases.append(total)
        total += 1 << bits
    f = Fn(module, name, ptr, [ptr, ptr, ptr, ptr, i64], ["src", "A", "B", "H", "n"])
    src, A, B, H, n = f.args
    b = f.b
    sign = const(i64, 1 << 63)
    zero = const(i64, 0)

    def digit(word, p):
        shift, bits = digits[p]
        d = b.and_(b.lshr(b.xor(word, sign), const(i64, 32 + shift)), const(i64, (1 << bits) - 1))
        return b.add(d, const(i64, bases[p]))
    with f.for_range(0, total, name="z") as z:
        f.store(zero, H, z)
    with f.for_range(zero, n, name="h") as i:
        word = f.load(i64, src, i)
        for p in range(len(digits)):
            slot = digit(word, p)
            f.store(b.add(f.load(i64, H, slot), const(i64, 1)), H, slot)
    cur = f.var(ptr, src, "cur")
    for p, (_, bits) in enumerate(digits):
        d0 = digit(f.load(i64, cur.get(), zero), p)
        with f.if_(b.icmp_signed("!=", f.load(i64, H, d0), n)):
            run = f.var(i64, zero, "run")
            with f.for_range(bases[p], bases[p] + (1 << bits), name="pre") as slot:
                c = f.load(i64, H, slot)
                f.store(run.get(), H, slot)
                run.set(b.add(run.get(), c))
            s = cur.get()
            dst = b.select(b.icmp_unsigned("==", s, A), B, A)
            with f.for_range(zero, n, name="scatter") as i:
                word = f.load(i64, s, i)
                slot = digit(word, p)
                pos = f.load(i64, H, slot)
                f.store(b.add(pos, const(i64, 1)), H, slot)
                f.store(word, dst, pos)
            cur.set(dst)
    f.ret(cur.get())
    return f.finish()
