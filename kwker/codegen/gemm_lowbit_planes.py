"""int8 prefill on int8 matrix tiles, exact to float32: x's byte planes times the weights.

The decode kernel's byte planes (gemm_lowbit_vnni.py) make many x rows an unsigned int8 matrix
of three rows per x row; times the int8 weights on the u8s8 tile GEMM (``tdpbusd``, gemm_tile.py)
they give each plane's int32 sums, which combine into the linear (``combine_planes``):

    y = (S0 + 2**8 S1 + 2**16 S2 - 2**23 sum_k q) * 2**(E - 22) * scale[n] + bias[n]

then the activation, the residual and one rounding to the model's dtype. The three planes cost
1.5x a bf16 product on the tiles (``tdpbusd`` does twice ``tdpbf16ps``'s products), against
the float32 FMAs of dequantised weights the prefill ran before. Where the user allows float32
products below full precision (``torch.set_float32_matmul_precision("high")`` or ``"medium"``),
x takes two planes (16 bits, x to 2**-15 of its row's largest |x|, finer than TF32's 2**-11 a
value):

    y = (S0 + 2**8 S1 - 2**15 sum_k q) * 2**(E - 14) * scale[n] + bias[n]

which is the cost of a bf16 product on the tiles, and on ``vpdpbusd`` 2/3 of the three planes'.

The kernels of this module, per call:

- ``lowbit_planes``: x rows -> their planes (rows of ``plane_stride(K)`` bytes) and heads;
- ``lowbit_panels``: a block of W rows (int8, row-major, read in place) -> AMX's B layout, the
  u8s8 GEMM's pre-packed panels (32 columns, a 32-bit word of 4 k per column, K zero-padded to
  whole tile steps), so no packed copy of the weights outlives the call; int4 W rows (the
  decode's packed nibbles) -> grouped panels (``_emit_panels4``: per 32 k the weights, their
  columns' sums and scales; for 12-bit planes, words of two k as ``(q, 16 q)`` bytes and no
  sums).

The u8s8 GEMM's epilogue combines each x row's planes (``GemmSpec.planes``): on ``vpdpbusd``
in the micro-kernel's registers, its 12-row tiles holding whole x rows; on the tiles from each
32-row block's sums, whose rows hold whole x rows' planes (gemm_tile.py). The rows whose head
says "float path" (non-finite or tiny x) come out as garbage there: the factory runs them
through the decode kernel afterwards.
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, gemm_lowbit, omp, simd
from .gemm_lowbit_vnni import (
    GROUP_QUADS,
    HEAD,
    emit_planes,
    row_bytes,
)
from .gemm_tile import STEP as TILE_STEP
from .gemm_tile import TILE_BLOCK
from .gemm_tile_grouped import group_rows
from .irutil import const, f32, i8, i32, i64, intrinsic, new_module, ptr

NR = TILE_BLOCK[1]


def panel_words(k: int) -> int:
    """k-quad words of a panel (a word of 4 k per column): K padded to whole tile steps."""
    quads = -(-k // 4)
    return -(-quads // TILE_STEP) * TILE_STEP


def emit(spec, target) -> ir.Module:
    if spec.family == "lowbit_panels" and spec.bits == 4:
        return _emit_panels4(spec, target)
    emit_family = {"lowbit_planes": _emit_planes, "lowbit_panels": _emit_panels}
    return emit_family[spec.family](spec, target)


def grouped_words(k: int, plane_bits: int = 8) -> int:
    """Words of one grouped panel (int4, ``_emit_panels4``): per group of ``GROUP_QUADS`` k
    quads, ``group_rows(plane_bits)`` rows of ``NR`` words."""
    return panel_words(k) // GROUP_QUADS * group_rows(plane_bits) * NR


def _parallel(spec, slots: int, total_of):
    """(module, body, the ``slots`` pointer arguments, the thread's [begin, end)) of a kernel
    whose threads split ``total_of(context)`` items."""
    module = new_module(spec.symbol)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    ctx = omp.Context(body, body.args[0])
    args = [ctx.ptr(i) for i in range(slots)]
    begin, end = omp.split(body, total_of(ctx), body.args[1], body.args[2])
    return module, body, args, (begin, end)


def _emit_planes(spec, target) -> ir.Module:
    """``sym(x, planes, heads, rows, nthreads)``."""
    module, body, (x, planes, heads), (begin, end) = _parallel(
        spec, 3, lambda ctx: ctx.i64(3))
    b = body.b
    elem_bytes = bf16.itemsize(spec.dtype)
    xs = simd.gep(b, x, b.mul(begin, const(i64, spec.k * elem_bytes)), i8)
    ps = simd.gep(b, planes, b.mul(begin, const(i64, row_bytes(spec.k, spec.planes,
                                                                spec.plane_bits))), i8)
    hs = simd.gep(b, heads, b.mul(begin, const(i64, HEAD)), i8)
    emit_planes(body, spec.k, spec.dtype, xs, ps, hs, b.sub(end, begin), spec.planes,
                spec.plane_bits)
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 3 + [i64], body.fn)
    return module


def _emit_panels(spec, target) -> ir.Module:
    """``sym(w, panels, nthreads)``: W rows ``0 .. n`` (K int8 each) -> ``ceil(n / 32)`` panels
    of ``panel_words(K)`` rows of 32 words, zero past N and K. Threads split the panels; per
    16 rows and 16 k-quads, 16 loads of 64 bytes, a 16 x 16 transpose of words in registers and
    16 stores (a word at a time was 4x the instructions)."""
    np_ = -(-spec.n // NR)
    module, body, (w, panels), (begin, end) = _parallel(
        spec, 2, lambda ctx: const(i64, np_))
    b, k = body.b, spec.k
    kw = panel_words(k)
    vt = ir.VectorType(i32, 16)
    bt = ir.VectorType(i8, 64)
    zero = ir.Constant(vt, [0] * 16)
    with body.for_range(begin, end, name="p") as p:
        dst = simd.gep(b, panels, b.mul(p, const(i64, kw * NR)), i32)
        for half in range(NR // 16):
            rows = [b.add(b.mul(p, const(i64, NR)), const(i64, half * 16 + j))
                    for j in range(16)]
            live = [b.icmp_signed("<", n, const(i64, spec.n)) for n in rows]
            # a row past N reads row N - 1 (valid memory) and is zeroed
            src = [simd.gep(b, w, b.mul(b.select(ok, n, const(i64, spec.n - 1)),
                                        const(i64, k)), i8) for n, ok in zip(rows, live)]

            def chunk(c, valid: int):
                at = b.mul(c, const(i64, 64))
                vs = []
                for row, ok in zip(src, live):
                    raw = simd.load_any(b, row, at, 64, valid, elem=i8) if valid > 0 else \
                        ir.Constant(bt, [0] * 64)
                    vs.append(b.select(ok, b.bitcast(raw, vt), zero))
                for t, v in enumerate(_transpose16(b, vs)):
                    q = b.add(b.mul(c, const(i64, 16)), const(i64, t))
                    b.store(v, simd.gep(b, dst, b.add(b.mul(q, const(i64, NR)),
                                                      const(i64, half * 16)), i32), align=4)

            if k // 64:
                with body.for_range(0, k // 64, name="c") as c:
                    chunk(c, 64)
            for c in range(k // 64, kw // 16):   # the tail chunk, then zero padding
                chunk(const(i64, c), k - 64 * c if k > 64 * c else 0)
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 2, body.fn)
    return module


def _emit_panels4(spec, target) -> ir.Module:
    """``sym(w, scale, zp, panels, nthreads)``: int4 W rows ``0 .. n`` in gemm_lowbit.py's
    layout (nibbles ``q + 8``; float32 scales and int8 zero points per group) -> ``ceil(n /
    32)`` grouped panels (``grouped_words``): per 32 k, 8 rows of 32 quad words of ``q - zp``
    (s8, zero past N and K), then the columns' sums of those (int32, one ``vpdpbusd`` by ones a
    row) and their scales (float32). Threads split the panels; per 16 rows and 64 k, a load of
    16 nibble words a row (4 of their nibbles are the 64 k), their bytes split into low and high
    nibbles and put in k order by one two-source byte shuffle, a 16 x 16 transpose of words.
    ``plane_bits`` 12 (symmetric weights): per 32 k, 16 rows of words of two k, ``(q, 16 q)``
    bytes each (``16 q`` fits s8 for q in [-8, 7]), times the 12-bit planes' ``(d & 15, d >>
    4)`` bytes, then the scales (no sums: those planes have no offset to take them from): each
    quad word of the transpose two words by a byte shuffle. A group's 16 scales come by one
    gather. Against four nibble extractions a row, (12-bit) two transposes a step and 16 scalar
    loads and inserts a group's scales, Emerald Rapids, 2 threads: 2304 x 768 0.10-0.11 ->
    0.05 ms (8-bit panels), 0.19 -> 0.11-0.14 (12-bit)."""
    n, k, L = spec.n, spec.k, spec.lanes
    module, body, (w, scale, zp, panels), (begin, end) = _parallel(
        spec, 4, lambda ctx: const(i64, -(-n // NR)))
    b = body.b
    kp = gemm_lowbit.padded_k(spec, L)
    chunks, groups = kp // gemm_lowbit.chunk(4, L), gemm_lowbit.groups(spec, L)
    vt, bt = ir.VectorType(i32, 16), ir.VectorType(i8, 64)
    ones = ir.Constant(vt, [0x01010101] * 16)
    dot = intrinsic(module, "llvm.x86.avx512.vpdpbusd.512", vt, [vt, vt, vt])
    lane = ir.Constant(ir.VectorType(i64, 64), list(range(64)))
    low_half = ir.Constant(ir.VectorType(ir.IntType(1), 64), [i < 32 for i in range(64)])
    twelve = spec.plane_bits == 12
    rows_g = group_rows(spec.plane_bits)
    nibble, four = ir.Constant(bt, [15] * 64), ir.Constant(bt, [4] * 64)
    ft = simd.vty(16)
    gather = intrinsic(module, "llvm.masked.gather.v16f32.v16p0", ft,
                       [ir.VectorType(ptr, 16), i32, ir.VectorType(ir.IntType(1), 16), ft])
    every = ir.Constant(ir.VectorType(ir.IntType(1), 16), [1] * 16)
    # byte 16 j + i of a step's 64 k: nibble j of word i, i.e. of its byte j // 2 (j odd: high)
    idx = ir.VectorType(i32, 64)
    in_k_order = ir.Constant(idx, [64 * (t // 16 % 2) + 4 * (t % 16) + t // 32
                                   for t in range(64)])
    # a quad word (q0, q1, q2, q3) of each column -> (q0, 16 q0, q1, 16 q1), (q2, 16 q2, ...)
    pair_orders = [ir.Constant(idx, [4 * (t // 4) + 2 * half + t % 4 // 2 + 64 * (t % 2)
                                     for t in range(64)]) for half in range(2)]
    with body.for_range(begin, end, name="p") as p:
        dst = simd.gep(b, panels, b.mul(p, const(i64, grouped_words(k, spec.plane_bits))), i32)
        for half in range(NR // 16):
            rows = [b.add(b.mul(p, const(i64, NR)), const(i64, half * 16 + j)) for j in range(16)]
            live = [b.icmp_signed("<", r, const(i64, n)) for r in rows]
            # a row past N reads row N - 1 (valid memory) and is zeroed
            rows = [b.select(ok, r, const(i64, n - 1)) for r, ok in zip(rows, live)]
            src = [simd.gep(b, w, b.add(b.mul(b.udiv(r, const(i64, spec.rr)),
                                              const(i64, chunks * spec.rr * L)),
                                        b.mul(b.urem(r, const(i64, spec.rr)), const(i64, L))),
                            i32) for r in rows]
            scale_at = ir.Constant(vt, None)   # the rows' first scales, for one gather a group
            for j, r in enumerate(rows):
                scale_at = b.insert_element(scale_at, b.trunc(b.mul(r, const(i64, groups)), i32),
                                            const(i32, j))
            with body.for_range(0, panel_words(k) // 16, name="h") as h:   # 64 k a step
                k0 = b.mul(h, const(i64, 64))
                g = [b.udiv(b.add(k0, const(i64, 32 * s)), const(i64, spec.group))
                     for s in range(2)]
                in_k = b.icmp_signed("<", b.add(simd.broadcast(b, k0, 64), lane),
                                     simd.broadcast(b, const(i64, k), 64))
                at = b.mul(b.lshr(h, const(i64, 1)), const(i64, spec.rr * L))
                shift = b.trunc(b.mul(b.and_(h, const(i64, 1)), const(i64, 16)), i32)
                vs = []
                for row, src_row, ok in zip(rows, src, live):
                    words = simd.load_vec(b, src_row, at, 16, elem=i32)
                    # the step's 4 nibbles of each word in its bytes 0 and 1, split into low
                    # and high nibbles and gathered in k order by one byte shuffle
                    by = b.bitcast(b.lshr(words, simd.broadcast(b, shift, 16)), bt)
                    u = b.shuffle_vector(b.and_(by, nibble), b.and_(b.lshr(by, four), nibble),
                                         in_k_order)
                    if spec.zero_point:
                        z = [b.add(simd.load_scalar(b, zp, b.add(b.mul(row, const(
                            i64, groups)), gi), i8), const(i8, 8)) for gi in g]
                        off = b.select(low_half, simd.broadcast(b, z[0], 64),
                                       simd.broadcast(b, z[1], 64))
                    else:
                        off = ir.Constant(bt, [8] * 64)
                    q = b.select(b.and_(in_k, simd.broadcast(b, ok, 64)),
                                 b.sub(u, off), ir.Constant(bt, [0] * 64))
                    vs.append(q)
                quads = _transpose16(b, [b.bitcast(q, vt) for q in vs])
                if twelve:   # per group, 16 words of two k: each quad's (q, 16 q) bytes
                    pair_words = []
                    for quad in quads:
                        by = b.bitcast(quad, bt)
                        by16 = b.shl(by, four)
                        pair_words += [b.bitcast(b.shuffle_vector(by, by16, order), vt)
                                       for order in pair_orders]
                    words = [pair_words[:2 * GROUP_QUADS], pair_words[2 * GROUP_QUADS:]]
                else:
                    words = [quads[:GROUP_QUADS], quads[GROUP_QUADS:]]
                for s in range(2):
                    grp = b.add(b.mul(h, const(i64, 2)), const(i64, s))
                    base = b.add(b.mul(grp, const(i64, rows_g * NR)), const(i64, half * 16))
                    for t, word in enumerate(words[s]):
                        simd.store_vec(b, word, dst, b.add(base, const(i64, t * NR)), elem=i32)
                    if not twelve:   # (12-bit planes have no offset to take the sums from)
                        sums = ir.Constant(vt, [0] * 16)
                        for word in words[s]:
                            sums = b.call(dot, [sums, ones, word])
                        simd.store_vec(b, sums, dst, b.add(base, const(i64, (rows_g - 2) * NR)),
                                       elem=i32)
                    at_g = b.add(scale_at, simd.broadcast(b, b.trunc(g[s], i32), 16))
                    ptrs = b.gep(scale, [at_g], inbounds=True, source_etype=f32)
                    ptrs.type = ir.VectorType(ptr, 16)   # (llvmlite types it a scalar pointer)
                    scales = b.call(gather, [ptrs, const(i32, 4), every, ir.Constant(ft, None)])
                    simd.store_vec(b, scales, dst, b.add(base, const(i64, (rows_g - 1) * NR)))
    body.finish()
    omp.emit_parallel(module, spec.symbol, [ptr] * 4, body.fn)
    return module


def _transpose16(b, vs: list) -> list:
    """The 16 x 16 transpose of 16 vectors of 16 words: four levels, each swapping the
    off-diagonal blocks of half the previous size between pairs of vectors."""
    vs = list(vs)
    mt = ir.VectorType(i32, 16)
    size = 8
    while size:
        lo = [lane if not lane & size else 16 + lane - size for lane in range(16)]
        hi = [lane + size if not lane & size else 16 + lane for lane in range(16)]
        for i in range(16):
            if not i & size:
                a, c = vs[i], vs[i | size]
                vs[i] = b.shuffle_vector(a, c, ir.Constant(mt, lo))
                vs[i | size] = b.shuffle_vector(a, c, ir.Constant(mt, hi))
        size //= 2
    return vs
