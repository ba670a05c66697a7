"""The stable sort: an LSD radix sort on order-preserving integer keys.

Any stable sort gives the one stable order, so no libstdc++ step needs emulating here.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

from llvmlite import ir

from .irutil import Fn, const, i1, i32, i64, ptr


def radix_digits(key_type: ir.IntType, step: int | None = None) -> list[tuple[int, int]]:
    """(shift, bits) of each LSD pass: 11-bit digits for 32-bit keys (three passes, their
    counters fit in L1), bytes for 64-bit keys; ``step`` bits a digit if given."""
    width = key_type.width
    step = step or (11 if width == 32 else 8)
    return [(s, min(step, width - s)) for s in range(0, width, step)]


# Rows of packed words whose keys vary in every 11-bit digit take four byte passes instead of
# three 11-bit ones from a row length the caller gives (measured per CPU by ops.thresholds;
# built in: ops.sorting.RADIX_BYTES_ROW): a pass then scatters into 256 buckets, whose write
# positions stay in L1, where 2048 miss it (Emerald Rapids, 2 threads, sort of (32, 20000) randn
# float32, in one process: stable 2.49-2.58 -> 2.15-2.21 ms, unstable 3.19-3.50 -> 2.88-3.05).
# Short rows measured no faster with bytes ((8, 4096): stable 0.80x, unstable 0.91x), and keys
# varying in fewer bits (tie-heavy rows) need fewer 11-bit passes than byte passes.


# The last pass's digit (the keys' top bits: sign and exponent for floats) is counted into this
# many copies of its counters, element i into copy i % TOP_COPIES, then summed: where few values
# share the top digit, one set of counters took the same counter for element after element, a
# chain of stores and reloads of one address. Emerald Rapids, 2 threads, stable sort of (32,
# 20000) randint(0, 4) float32, three pairs of alternating processes: 1.11-1.19 -> 1.02-1.05 ms;
# randn rows level (their histogram pays its four counter updates an element, not a chain).
TOP_COPIES = 4


def radix_hist_bytes(key_type: ir.IntType) -> int:
    """Bytes of i64 counters the radix sorts of ``key_type`` keys need (both digit sizes of
    32-bit keys)."""
    sets = [radix_digits(key_type)]
    if key_type.width == 32:
        sets.append(radix_digits(key_type, 8))
    return max(_bases(d)[2] for d in sets) * 8


def _bases(digits) -> tuple[list[int], int, int]:
    """Each pass's first counter in the histogram block, the first counter of the last digit's
    other copies, and the block's counter count."""
    bases, total = [], 0
    for _, bits in digits:
        bases.append(total)
        total += 1 << bits
    return bases, total, total + (TOP_COPIES - 1) * (1 << digits[-1][1])


def _histograms(f: Fn, H, n, digits, load, digit, varying, shift: int = 0):
    """Every pass's digit counts in one read of the n elements (``load(i)``; ``digit(x, p)``
    the counter slot of element x in pass p), counting only digits that vary (``varying``: the
    bits in which the keys differ, found by the caller as it wrote them, the keys' bits
    ``shift`` up): a digit the same for every key gets its one count, n, without the loop. A
    counter incremented by element after element is a chain of stores and reloads of one
    address; tie-heavy rows (randint(0, 4) as float32: the low 22 bits of every key zero) spent
    most of a stable sort there, and the last digit's copies (``TOP_COPIES``) break the chain
    where few values share the top digit."""
    b = f.b
    bases, copies, count_all = _bases(digits)
    top, top_size = len(digits) - 1, 1 << digits[-1][1]
    with f.for_range(0, count_all, name="z") as z:
        f.store(const(i64, 0), H, z)
    vt = varying.type
    varies = [b.icmp_unsigned("!=", b.and_(varying, const(vt, ((1 << bits) - 1) << (s + shift))),
                              const(vt, 0)) for s, bits in digits]

    def add(x, tested: bool, copy: int) -> None:
        for p in range(len(digits)):
            with f.if_(varies[p]) if tested else nullcontext():
                slot = digit(x, p)
                if p == top and copy:
                    slot = b.add(slot, const(i64, copies + (copy - 1) * top_size - bases[top]))
                f.store(b.add(f.load(i64, H, slot), const(i64, 1)), H, slot)

    def count(tested: bool):
        """The loop over the elements; ``tested``: a digit counted only where it varies."""
        whole = b.and_(n, const(i64, -TOP_COPIES))
        with f.for_range(const(i64, 0), whole, step=TOP_COPIES, name="h") as i:
            for u in range(TOP_COPIES):
                add(load(b.add(i, const(i64, u))), tested, u)
        with f.for_range(whole, n, name="ht") as i:
            add(load(i), tested, 0)

    every = varies[0]
    for v in varies[1:]:
        every = b.and_(every, v)
    with f.if_else(every, likely=True) as (plain, some):
        with plain:  # no test per element where every digit varies (random keys, long rows)
            count(False)
        with some:
            count(True)
    with f.for_range(0, top_size, name="merge") as d:
        slot = b.add(d, const(i64, bases[top]))
        total = f.load(i64, H, slot)
        for u in range(1, TOP_COPIES):
            other = b.add(d, const(i64, copies + (u - 1) * top_size))
            total = b.add(total, f.load(i64, H, other))
        f.store(total, H, slot)
    with f.if_(b.icmp_signed(">", n, const(i64, 0))):
        first = load(const(i64, 0))
        for p in range(len(digits)):
            with f.if_(b.not_(varies[p])):
                f.store(n, H, digit(first, p))


def _take(f: Fn, H, slot):
    """The next free position of bucket ``slot`` (its counter advanced)."""
    pos = f.load(i64, H, slot)
    f.store(f.b.add(pos, const(i64, 1)), H, slot)
    return pos


@contextmanager
def _pass_needed(f: Fn, H, n, first_digit, start: int, bits: int):
    """Context of a pass whose digit is not the same for every key (``first_digit``: the
    first key's slot; its bucket would hold all n), its counters turned into bucket starts."""
    b = f.b
    with f.if_(b.icmp_signed("!=", f.load(i64, H, first_digit), n)):
        run = f.var(i64, const(i64, 0), "run")
        with f.for_range(start, start + (1 << bits), name="pre") as slot:
            c = f.load(i64, H, slot)
            f.store(run.get(), H, slot)
            run.set(b.add(run.get(), c))
        yield


def emit_radix_sort(module: ir.Module, key_type: ir.IntType, name: str) -> ir.Function:
    """Stable ascending sort of signed integer keys with their i32 indices (LSD radix).

    ``radix(K, I, K2, I2, hist, n, varying) -> i1``: true when the result ended in (K2, I2).
    ``hist`` holds ``radix_hist_bytes`` of i64 counters; ``varying`` (of the key type): the bits
    in which the keys differ (all ones if not known). Passes whose digit is the same for every
    key are skipped.
    """
    digits = radix_digits(key_type)
    bases = _bases(digits)[0]
    f = Fn(module, name, i1, [ptr, ptr, ptr, ptr, ptr, i64, key_type],
           ["K", "I", "K2", "I2", "H", "n", "varying"])
    K, I, K2, I2, H, n, varying = f.args
    b = f.b
    kt = key_type
    sign = const(kt, 1 << (kt.width - 1))
    zero = const(i64, 0)

    def digit(key, p):
        shift, bits = digits[p]
        d = b.and_(b.lshr(b.xor(key, sign), const(kt, shift)), const(kt, (1 << bits) - 1))
        return b.add(b.zext(d, i64) if kt.width < 64 else d, const(i64, bases[p]))
    _histograms(f, H, n, digits, lambda i: f.load(kt, K, i), digit, varying)
    src_k, src_i = f.var(ptr, K, "sk"), f.var(ptr, I, "si")
    dst_k, dst_i = f.var(ptr, K2, "dk"), f.var(ptr, I2, "di")
    flipped = f.var(i1, const(i1, 0), "flipped")
    for p, (_, bits) in enumerate(digits):
        with _pass_needed(f, H, n, digit(f.load(kt, src_k.get(), zero), p), bases[p], bits):
            sk, si, dk, di = src_k.get(), src_i.get(), dst_k.get(), dst_i.get()
            with f.for_range(zero, n, name="scatter") as i:
                key = f.load(kt, sk, i)
                pos = _take(f, H, digit(key, p))
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
    """Stable ascending sort of packed (i32 key << 32 | index) words by their key (LSD radix):
    one 8-byte store per element and pass, where the key/index pair costs two stores to two
    arrays' cache lines. The digits of ``radix_digits(i32)``, or bytes for rows of at least
    ``bytes_from`` words whose keys vary in every 11-bit digit (0: never; see above).

    ``radix(src, A, B, hist, n, varying, bytes_from) -> ptr``: the array holding the result, A
    or B (``src`` itself only when every pass is skipped); ``src`` is never written. ``hist``
    holds ``radix_hist_bytes(i32)`` of i64 counters; ``varying`` (i64): the bits in which the
    words' keys differ (all ones if not known). Passes whose digit is the same for every key are
    skipped.
    """
    wide = _emit_radix_packed(module, f"{name}.d11", radix_digits(ir.IntType(32)))
    byte = _emit_radix_packed(module, f"{name}.d8", radix_digits(ir.IntType(32), 8))
    f = Fn(module, name, ptr, [ptr, ptr, ptr, ptr, i64, i64, i64],
           ["src", "A", "B", "H", "n", "varying", "bytes_from"])
    b = f.b
    n, varying, bytes_from = f.args[4:]
    spread = b.and_(b.icmp_signed(">", bytes_from, const(i64, 0)),
                    b.icmp_signed(">=", n, bytes_from))
    for shift, bits in radix_digits(ir.IntType(32)):
        mask = const(i64, ((1 << bits) - 1) << (32 + shift))
        spread = b.and_(spread, b.icmp_unsigned("!=", b.and_(varying, mask), const(i64, 0)))
    out = f.var(ptr, ir.Constant(ptr, None), "out")
    with f.if_else(spread) as (in_bytes, in_wide):
        with in_bytes:
            out.set(b.call(byte, f.args[:6]))
        with in_wide:
            out.set(b.call(wide, f.args[:6]))
    f.ret(out.get())
    return f.finish()


def _emit_radix_packed(module: ir.Module, name: str, digits) -> ir.Function:
    """``emit_radix_sort_packed``'s sort with the given digits."""
    bases = _bases(digits)[0]
    f = Fn(module, name, ptr, [ptr, ptr, ptr, ptr, i64, i64],
           ["src", "A", "B", "H", "n", "varying"])
    src, A, B, H, n, varying = f.args
    b = f.b
    sign = const(i64, 1 << 63)
    zero = const(i64, 0)

    def digit(word, p):
        shift, bits = digits[p]
        d = b.and_(b.lshr(b.xor(word, sign), const(i64, 32 + shift)), const(i64, (1 << bits) - 1))
        return b.add(d, const(i64, bases[p]))
    _histograms(f, H, n, digits, lambda i: f.load(i64, src, i), digit, varying, shift=32)
    cur = f.var(ptr, src, "cur")
    for p, (_, bits) in enumerate(digits):
        with _pass_needed(f, H, n, digit(f.load(i64, cur.get(), zero), p), bases[p], bits):
            s = cur.get()
            dst = b.select(b.icmp_unsigned("==", s, A), B, A)
            with f.for_range(zero, n, name="scatter") as i:
                word = f.load(i64, s, i)
                f.store(word, dst, _take(f, H, digit(word, p)))
            cur.set(dst)
    f.ret(cur.get())
    return f.finish()
