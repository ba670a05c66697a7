"""Weight-only low-bit linear ``out = act(x @ deq(W).T + bias) + residual``: the GEMM family's
decode (GEMV) schedule for int8 and int4 weights, widened in registers.

Decoding reads every weight once per token, so the kernel streams the weights at memory speed and
never holds a float copy of them. ``deq(W)[n, k] = (q[n, k] - zp[n, g]) * scale[n, g]`` with
``g = k // group`` (torchao's affine dequantisation, float32).

Weights, by ``bits``:

- 8: ``q`` as torchao holds it, (N, K) int8 row-major, read in place (no copy). Per W row and
  group, the float32 partial sums ``sum_k x[k] * (q - zp)`` (exact small integers times x) are
  scaled once at the end of the group: one vector FMA per group instead of one per weight.
- 4: repacked two per byte by the factory (``kernels/linear_lowbit.pack_int4``): chunks of
  ``8 * lanes`` weights in ``lanes`` 32-bit words, weight ``k = chunk * 8L + j * L + l`` in
  nibble ``j`` of word ``l`` as ``u = q + 8``; K padded to whole chunks and groups with ``u = 8``;
  the chunks of a block of ``rr`` rows interleaved (chunk 0 of each row, then chunk 1...), so a
  thread reads its rows as one sequential stream, prefetched ``spec.ahead`` bytes on. A
  nibble becomes its weight through a 16-entry table per row and group,
  ``table[u] = (u - 8 - zp) * scale``, looked up with one ``vpermps`` (AVX-512: the index is
  the word's low 4 bits, so a shift exposes each nibble): exactly torchao's float32 dequantised
  weight. AVX2 has no such lookup: there the nibbles are summed against x as they are and the
  zero-point term is taken off per unit (``gemm_lowbit_fold``, blocks of one row), with the
  exact form kept for x holding inf, NaN, values near overflow or tiny ones.

Both forms cost three vector instructions per 16 weights on AVX-512 (widen or shift, convert or
look up, FMA), and are bound by them where the weights come from cache (Emerald Rapids, 2 threads,
1024 x 1024 warm: int8 29 G weights/s). With ``spec.vnni`` (int8 per output channel on a CPU with
AVX512_VNNI) the int8 form runs instead on ``vpdpbusd`` over x split into byte planes,
3 instructions per 64 weights and exact to float32 (gemm_lowbit_vnni.py): 40 G weights/s there;
int4 (groups of 32, 64 or multiples of 128 k) likewise, on x's signed digits and the
packed nibbles transposed by one ``vpshufb`` (gemm_lowbit_vnni4.py): 16 instructions per 128
weights instead of ~28 (GPT-2's 49 int4 GEMVs, Emerald Rapids: 1.27-1.38x faster).

``scale`` is float32 (N, groups) and ``zp`` int8 (N, groups) (read only with
``zero_point=True``; int4 groups padded as the weights are).

Schedule: x (``m`` rows, or ``rows`` at run time for ``m == 0``) is widened once per thread into a
float32 buffer padded with zeros to whole vectors. Threads split the W rows into contiguous ranges
of ``rr``-row blocks; per block the x rows go by tiles of ``mr`` (the block's weights stay in L1
across the tiles), keeping ``mr * rr`` vector accumulators; a lone x row reads int8 rows one
after another (``_Tile._int8_rows``; on vpdpbusd the streamed tile), one stream a thread.
On AVX2, weights are prefetched non-temporally where they are read once: streamed through the
caches as usual, 124 MB of GPT-2 weights a token evicted everything the interpreter and the other
ops use (a 768-wide LayerNorm after the int8 head: 6 -> 45-140 us on Zen 3). On AVX-512 they are
prefetched into every level, as int4's always were: on Intel cores a non-temporal prefetch fills
L1 alone and the 16 fill buffers bound a thread's stream (Emerald Rapids-class Xeon, 2 threads,
int8 in groups of 32, weights in L3: 2304 x 768 14.3 -> 39.8 GB/s); on Zen 4 non-temporal
prefetches of the decode streams did not keep the rest of a token faster either (GPT-2 decode,
alternating processes: int8 100-105 against 111-113 tokens/s, int4 155-160 against 176-186).
How far ahead, or whether at all, is ``spec.ahead``, measured per machine on AVX-512
(kernels/lowbit_stream.py): the Xeon's streams needed the software prefetch (int4 GPT-2's 49
GEMVs 6.1-6.6 -> 3.7-3.8 ms), while on Zen 4 the hardware prefetchers alone kept them faster
(the same 49 GEMVs, 2 threads, one process: int8 5.7 -> 4.7 ms, int4 3.9 -> 3.3 ms).
Each (x row, W row) sum is reduced across lanes into a float32 scratch row, then the epilogue
runs as vectors over the thread's columns: ``act(sum + bias) + residual``, rounded once to bf16
for a bf16 model.

ABI: ``sym(x, w, scale, zp, bias, res, out[, rows], nthreads)``; ``bias``, ``res``, ``zp`` may be
null when the spec says they are absent; with ``spec.vnni`` and int8, ``zp`` holds the W rows'
sums of q (int32).
"""
from __future__ import annotations

from llvmlite import ir

from . import bf16, gemm_lowbit_fold, gemm_lowbit_vnni, gemm_lowbit_vnni4, omp, simd, vmath
from .gemm_micro import epilogue_masked
from .irutil import (
    Fn,
    aligned_malloc,
    const,
    f32,
    i8,
    i16,
    i32,
    i64,
    intrinsic,
    new_module,
    ptr,
    void,
)

GRAIN = 1 << 16     # weights per thread before a second thread pays for its fork (~2 us)
LINE = 64           # bytes
CHAINS = 4          # accumulators of one x row and W row (8 measured 1-8% slower, Zen 3)


def chunk(bits: int, lanes: int) -> int:
    """Weights per step of the K loop: one vector of int8, or ``lanes`` words of nibbles."""
    return lanes if bits == 8 else 8 * lanes


def padded_k(spec, lanes: int) -> int:
    """K as the weights are laid out: int8 as is, int4 rounded up to whole chunks and groups."""
    if spec.bits == 8:
        return spec.k
    step = max(chunk(4, lanes), spec.group)
    return -(-spec.k // step) * step


def groups(spec, lanes: int) -> int:
    """Scale groups per W row (int4: over the padded K)."""
    return -(-padded_k(spec, lanes) // spec.group)


def _check(spec, lanes: int) -> None:
    if spec.lanes != lanes:
        raise ValueError(f"kwker gemm_lowbit: packed for {spec.lanes} lanes, target has {lanes}")
    if spec.digits not in (2, 3) or spec.digits == 2 and spec.bits != 4:
        raise ValueError(f"kwker gemm_lowbit: {spec.digits} digits of x with int{spec.bits} "
                         "(2 or 3 with int4, 3 with int8)")
    check_format(spec, lanes)


def check_format(spec, lanes: int) -> None:
    """Bits, dtype and group size the layouts and kernels take (any spec with those fields)."""
    if spec.bits not in (4, 8) or spec.dtype not in ("f32", "bf16"):
        raise ValueError(f"kwker gemm_lowbit: bits {spec.bits}, dtype {spec.dtype!r}")
    g, c = spec.group, chunk(spec.bits, lanes)
    if spec.bits == 8 and not (g % lanes == 0 or g >= spec.k):
        raise ValueError(f"kwker gemm_lowbit: int8 group {g} is not whole vectors of {lanes}")
    if spec.bits == 4 and not (g % lanes == 0 and (c % g == 0 or g % c == 0)):
        raise ValueError(f"kwker gemm_lowbit: int4 group {g} does not tile chunks of {c}")


class _Tile:
    """Emits the (x rows) x (W rows) tile functions of one spec."""

    def __init__(self, module, spec, target):
        self.module, self.s = module, spec
        self.L = simd.float_lanes(target)
        self.avx512 = self.L == 16
        self.kp = padded_k(spec, self.L)
        self.ng = groups(spec, self.L)
        self.xpad = -(-self.kp // self.L) * self.L        # float32 x row, padded with zeros
        # int4 without a 16-float table (AVX2): each x row is followed by its sums per unit of
        # ``unit`` weights (lane by lane), for the zero-point term (gemm_lowbit_fold)
        self.fold = gemm_lowbit_fold.folds(spec.bits, self.L)
        self.chunk = chunk(spec.bits, self.L)
        self.unit = min(spec.group, chunk(4, self.L))
        units = self.kp // self.unit if self.fold else 0
        self.xstride = self.xpad + units * self.L
        self._made: dict = {}

    def get(self, mr: int, rr: int, exact: bool = False) -> ir.Function:
        """``tile(xbuf, w_rows, scale_rows, zp_rows, sums)``: ``sums[i * rr + r]`` = the dot of
        x row ``i`` with dequantised W row ``r`` (float32 scalars). ``exact``: without
        folding (for x the folded int4 tile cannot take)."""
        key = (mr, rr, exact)
        if key not in self._made and mr in ("vnni", "vnnis", "vnni2"):
            self._made[key] = gemm_lowbit_vnni.emit_tile(self.module, self.s, rr,
                                                         streamed=mr == "vnnis") \
                if self.s.bits == 8 else gemm_lowbit_vnni4.emit_tile(
                    self, rr, digits=2 if mr == "vnni2" else 3)
        if key not in self._made:
            f = Fn(self.module, f"{self.s.symbol}.tile{mr}x{rr}{'e' if exact else ''}", void,
                   [ptr] * 5, ["x", "w", "scale", "zp", "sums"])
            if self.s.bits == 8:
                self._int8(f, mr, rr)
            elif self.fold and not exact:
                gemm_lowbit_fold.emit_tile(self, f, mr, rr)
            else:
                self._int4(f, mr, rr)
            f.finish()
            self._made[key] = f.fn
        return self._made[key]

    # ------------------------------------------------------------------------------ int8
    def _int8(self, f: Fn, mr: int, rr: int) -> None:
        if mr == 1:
            return self._int8_rows(f, rr)
        b, L, s = f.b, self.L, self.s
        x, w, scale, zp, sums = f.args
        vt, it = simd.vty(L), simd.vty(L, i32)
        zero = vmath.splat(vt, 0.0)
        total = [[f.var(vt, zero, f"t{i}_{r}") for r in range(rr)] for i in range(mr)]
        part = [[f.var(vt, zero, f"p{i}_{r}") for r in range(rr)] for i in range(mr)]
        k = s.k
        zp_vec = [None] * rr      # the group's zero points, per W row

        def step(at, active):
            """One vector of k from ``at`` (i64) into the partial sums; ``active`` lanes."""
            for r in range(rr):
                at_r = b.add(at, const(i64, r * k))
                q = self._load_i8(b, w, at_r, active)
                qi = b.sext(q, it)
                if s.zero_point:
                    qi = b.sub(qi, zp_vec[r])
                wf = b.sitofp(qi, vt)
                for i in range(mr):
                    xv = simd.load_vec(b, x, b.add(at, const(i64, i * self.xstride)), L)
                    part[i][r].set(vmath.fma(b, xv, wf, part[i][r].get()))

        def close_group(gi):
            for r in range(rr):
                sv = simd.broadcast(b, simd.load_scalar(
                    b, scale, b.add(gi, const(i64, r * self.ng))), L)
                for i in range(mr):
                    total[i][r].set(vmath.fma(b, part[i][r].get(), sv, total[i][r].get()))
                    part[i][r].set(zero)

        def open_group(gi):
            for r in range(rr if s.zero_point else 0):
                zp_vec[r] = simd.broadcast(b, b.sext(simd.load_scalar(
                    b, zp, b.add(gi, const(i64, r * self.ng)), i8), i32), L)

        unroll = max(1, LINE // L)      # steps per cache line of a W row

        def sweep(base, vectors: int):
            """``vectors`` whole vectors from ``base``, a line of each W row per iteration,
            the same line of the next block of rows prefetched."""
            u = min(unroll, vectors)
            with f.for_range(0, vectors // u, name="c") as c:
                at = b.add(base, b.mul(c, const(i64, u * L)))
                for r in range(rr):
                    simd.prefetch(b, simd.gep(b, w, b.add(at, const(i64, r * k + rr * k)), i8))
                for j in range(u):
                    step(b.add(at, const(i64, j * L)), L)
            for j in range(vectors // u * u, vectors):
                step(b.add(base, const(i64, j * L)), L)

        def group(gi, base, vectors: int, tail: int):
            open_group(gi)
            if vectors:
                sweep(base, vectors)
            if tail:
                step(b.add(base, const(i64, vectors * L)), tail)
            close_group(gi)

        self._each_group(f, group)
        self._store_sums(f, total, sums, mr, rr)

    def _each_group(self, f: Fn, group) -> None:
        """``group(gi, base, vectors, tail)`` for each scale group of a W row: its index and
        first k (i64), its whole vectors, then the lanes of a last masked vector (the last, or
        only, group may end inside a vector)."""
        b, L, k = f.b, self.L, self.s.k
        g = min(self.s.group, k)
        full = k // g if g % L == 0 else 0
        if full:
            with f.for_range(0, full, name="g") as gi:
                group(gi, b.mul(gi, const(i64, g)), g // L, 0)
        rest = k - full * g
        if rest:
            group(const(i64, full), const(i64, full * g), rest // L, rest % L)

    def _int8_rows(self, f: Fn, rr: int) -> None:
        """One x row: the block's W rows one after another, each read as one sequential stream
        into ``CHAINS`` accumulators, prefetched ``spec.ahead`` bytes on. The thread's rows are
        contiguous, so its reads are a single stream. Reading a line of each of the block's
        rows in turn (as several x rows must, to reuse each line) is ``rr`` streams a thread,
        which the prefetchers followed at half the memory's speed. Zen 3, 2 threads, in one process:
        GPT-2's 48 int8 layer linears (85 MB from memory) 9.7 -> 12.0 GB/s, against a streaming
        read's 17-24; its int8 decode 33-45 -> 42-58 tokens/s."""
        b, L, s = f.b, self.L, self.s
        x, w, scale, zp, sums = f.args
        vt, it = simd.vty(L), simd.vty(L, i32)
        zero = vmath.splat(vt, 0.0)
        k = s.k
        g = min(s.group, k)
        chains = max(1, min(CHAINS, g // L))
        acc = [f.var(vt, zero, f"a{c}") for c in range(chains)]
        total = f.var(vt, zero, "t")
        with f.for_range(0, rr, name="r") as r:
            row = simd.gep(b, w, b.mul(r, const(i64, k)), i8)
            groups_at = b.mul(r, const(i64, self.ng))
            total.set(zero)
            zp_vec = [None]

            def step(at, active, c):
                qi = b.sext(self._load_i8(b, row, at, active), it)
                if s.zero_point:
                    qi = b.sub(qi, zp_vec[0])
                xv = simd.load_vec(b, x, at, L)
                acc[c].set(vmath.fma(b, xv, b.sitofp(qi, vt), acc[c].get()))

            def group(gi, base, vectors: int, tail: int):
                """``vectors`` whole vectors of k from ``base`` (then ``tail`` lanes)."""
                if s.zero_point:
                    zp_vec[0] = simd.broadcast(b, b.sext(simd.load_scalar(
                        b, zp, b.add(groups_at, gi), i8), i32), L)
                u = max(1, min(vectors, max(chains, LINE // L)))  # vectors an iteration
                if vectors // u:
                    with f.for_range(0, vectors // u, name="v") as v:
                        at = b.add(base, b.mul(v, const(i64, u * L)))
                        for line in range(0, u * L, LINE) if s.ahead else ():
                            simd.prefetch(b, simd.gep(b, row, b.add(at, const(
                                i64, s.ahead + line)), i8), keep=self.avx512)
                        for j in range(u):
                            step(b.add(at, const(i64, j * L)), L, j % chains)
                for j in range(vectors // u * u, vectors):
                    step(b.add(base, const(i64, j * L)), L, j % chains)
                if tail:
                    step(b.add(base, const(i64, vectors * L)), tail, 0)
                part = acc[0].get()
                for c in range(1, chains):
                    part = b.fadd(part, acc[c].get())
                sv = simd.broadcast(b, simd.load_scalar(b, scale, b.add(groups_at, gi)), L)
                total.set(vmath.fma(b, part, sv, total.get()))
                for a in acc:
                    a.set(zero)

            self._each_group(f, group)
            simd.store_scalar(b, simd.hsum(b, total.get()), sums, r)

    def _load_i8(self, b, w, at, active: int):
        """``active`` int8 of a W row at byte ``at`` (the rest 0): only real bytes are read."""
        return simd.load_any(b, w, at, self.L, active, elem=i8)

    # ------------------------------------------------------------------------------ int4
    def _int4(self, f: Fn, mr: int, rr: int) -> None:
        """Each nibble made torchao's float32 weight (a table lookup on AVX-512), then an FMA;
        on AVX2 the rows the folded tiles cannot take."""
        b, L, s = f.b, self.L, self.s
        x, w, scale, zp, sums = f.args
        vt, it = simd.vty(L), simd.vty(L, i32)
        zero = vmath.splat(vt, 0.0)
        total = [[f.var(vt, zero, f"t{i}_{r}") for r in range(rr)] for i in range(mr)]
        c = chunk(4, L)
        per_group = s.group // L                      # nibbles (vectors) a group spans
        base = ir.Constant(vt, [float(u - 8) for u in range(16)]) if self.avx512 else None
        table = [None] * rr

        def make_table(r, gi):
            sv = simd.broadcast(b, simd.load_scalar(b, scale, b.add(gi, const(i64, r * self.ng))),
                                L)
            off = None
            if s.zero_point:
                zf = b.sitofp(simd.load_scalar(b, zp, b.add(gi, const(i64, r * self.ng)), i8), f32)
                off = simd.broadcast(b, zf, L)
            if self.avx512:
                t = b.fsub(base, off) if off is not None else base
                table[r] = b.fmul(t, sv)        # (u - 8 - zp) * scale: torchao's value
            else:
                table[r] = (sv, off)

        def weight(r, word, j):
            shifted = b.lshr(word, ir.Constant(it, [4 * j] * L)) if j else word
            if self.avx512:
                return f.call_intrinsic("llvm.x86.avx512.permvar.sf.512", vt,
                                        [table[r], shifted])
            sv, off = table[r]
            u = b.sitofp(b.and_(shifted, ir.Constant(it, [15] * L)), vt)
            u = b.fsub(u, vmath.splat(vt, 8.0))
            if off is not None:
                u = b.fsub(u, off)
            return b.fmul(u, sv)

        stride = s.rr * L                             # words a chunk of the block's rows
        with f.for_range(0, self.kp // c, name="c") as ci:
            at = b.mul(ci, const(i64, stride))
            vals = [b.load(simd.gep(b, w, b.add(at, const(i64, r * L)), i32), typ=it, align=4)
                    for r in range(rr)]
            self.prefetch_int4(f, w, scale, ci, stride * 4)
            k0 = b.mul(ci, const(i64, c))
            for j in range(8):
                if (j * L) % s.group == 0:
                    gi = b.udiv(b.add(k0, const(i64, j * L)), const(i64, s.group)) \
                        if per_group <= 8 else b.udiv(k0, const(i64, s.group))
                    for r in range(rr):
                        make_table(r, gi)
                for r in range(rr):
                    wv = weight(r, vals[r], j)
                    for i in range(mr):
                        xv = simd.load_vec(b, x, b.add(k0, const(i64, i * self.xstride + j * L)),
                                           L)
                        total[i][r].set(vmath.fma(b, xv, wv, total[i][r].get()))
        self._store_sums(f, total, sums, mr, rr)

    def prefetch_int4(self, f: Fn, w, scale, ci, chunk_bytes: int, keep: bool = True) -> None:
        """Ask for the weights and scales ``spec.ahead`` bytes of weights past chunk ``ci`` of
        the block (with ``ahead`` 0, nothing: the machine's hardware prefetchers alone keep the
        thread's stream faster, ``kernels/lowbit_stream``)."""
        b, s = f.b, self.s
        if not s.ahead:
            return
        wat = b.add(b.mul(ci, const(i64, chunk_bytes)), const(i64, s.ahead))
        for line in range(0, chunk_bytes, LINE):
            simd.prefetch(b, simd.gep(b, w, b.add(wat, const(i64, line)), i8), keep)
        scale_bytes = chunk_bytes * 2 // s.group * 4     # the chunk's scales (4 B per group)
        sat = b.add(b.mul(ci, const(i64, scale_bytes)), const(i64, s.ahead * 8 // s.group))
        for line in range(0, scale_bytes, LINE):
            simd.prefetch(b, simd.gep(b, scale, b.add(sat, const(i64, line)), i8))

    def _store_sums(self, f: Fn, total, sums, mr: int, rr: int) -> None:
        b = f.b
        for i in range(mr):
            for r in range(rr):
                simd.store_scalar(b, simd.hsum(b, total[i][r].get()), sums,
                                  const(i64, i * rr + r))


def _widen_x(f: Fn, spec, tiles: _Tile, x, xbuf, rows):
    """x rows (float32 or bf16, K a row) -> float32 rows of ``tiles.xstride``, zero past K.
    With ``tiles.fold``, then the row's sums per unit, and the answer whether the folded tiles
    may take x (i1; gemm_lowbit_fold), x then scaled for them."""
    b, L, k, xstride = f.b, tiles.L, spec.k, tiles.xstride
    vt = simd.vty(L)
    zero = vmath.splat(vt, 0.0)
    bad = f.var(i64, const(i64, 0), "bad") if tiles.fold else None

    def put(v, dst, at):
        simd.store_vec(b, v, dst, at)
        if tiles.fold:
            gemm_lowbit_fold.screen_x(f, v, bad)

    with f.for_range(0, rows, name="xr") as r:
        src = simd.gep(b, x, b.mul(r, const(i64, k)), i16 if spec.dtype == "bf16" else f32)
        dst = simd.gep(b, xbuf, b.mul(r, const(i64, xstride)))
        if k // L:
            with f.for_range(0, k // L, name="xv") as v:
                at = b.mul(v, const(i64, L))
                put(bf16.load_as(b, spec.dtype, src, at, L), dst, at)
        if k % L:
            at = const(i64, k // L * L)
            put(bf16.load_as(b, spec.dtype, src, at, L, k % L), dst, at)
        for v in range(-(-k // L), tiles.xpad // L):
            simd.store_vec(b, zero, dst, const(i64, v * L))
        if tiles.fold:
            gemm_lowbit_fold.unit_sums(f, tiles, dst)
    return gemm_lowbit_fold.prepare_x(f, tiles, xbuf, rows, bad) if tiles.fold else None


def _epilogue(f: Fn, spec, lanes: int, sums, rows, n0, n1, bias, res, out) -> None:
    """out[i, n0:n1] = act(sums[i] + bias) + res[i] for every x row, as (masked) vectors."""
    b, L, n = f.b, lanes, spec.n
    width = b.sub(n1, n0)
    with f.for_range(0, rows, name="er") as i:
        srow = b.mul(i, width)
        orow = b.add(b.mul(i, const(i64, n)), n0)
        with f.for_range(0, width, step=L, name="ec") as col:
            mask = simd.lane_mask(b, L, b.sub(width, col))
            v = simd.masked_load(b, sums, b.add(srow, col), mask, L)
            epilogue_masked(b, v, simd.masked_load(b, bias, b.add(n0, col), mask, L)
                            if spec.bias else None, spec.epilogue,
                            res if spec.residual else None, out, b.add(orow, col), mask, L,
                            spec.dtype)


def _start(spec, target):
    """(lanes, module, tile emitter, parallel body, its argument block) of either kernel."""
    L = simd.float_lanes(target)
    _check(spec, L)
    module = new_module(spec.symbol)
    body = omp.body_fn(module, f"{spec.symbol}.body")
    return L, module, _Tile(module, spec, target), body, omp.Context(body, body.args[0])


def emit(spec, target) -> ir.Module:
    L, module, tiles, body, ctx = _start(spec, target)
    if spec.vnni and not gemm_lowbit_vnni4.either_usable(spec, L):
        raise ValueError(f"kwker gemm_lowbit: the vpdpbusd path takes int8 per output channel "
                         f"with K <= {gemm_lowbit_vnni.MAX_K} and no zero points, or int4 in "
                         f"groups of 32, 64 or multiples of 128 for one row or any ({spec})")
    b = body.b
    x, w, scale, zp, bias, res, out = (ctx.ptr(slot) for slot in range(7))
    rows = const(i64, spec.m) if spec.m else ctx.i64(7)
    n, rr, mr = spec.n, spec.rr, spec.mr
    blocks = -(-n // rr)
    begin, end = omp.split(body, blocks, body.args[1], body.args[2])
    with body.if_(b.icmp_signed("<", begin, end)):
        n0 = b.mul(begin, const(i64, rr))
        n1 = b.mul(end, const(i64, rr))
        n1 = b.select(b.icmp_signed(">", n1, const(i64, n)), const(i64, n), n1)
        xraw, xbuf = aligned_malloc(body, b.mul(rows, const(i64, tiles.xstride * 4)))
        sraw, sums = aligned_malloc(body, b.mul(b.mul(rows, b.sub(n1, n0)), const(i64, 4)))
        tsums = body.array(f32, mr * rr, "tile_sums")
        foldable = _widen_x(body, spec, tiles, x, xbuf, rows)
        planes = heads = None
        if spec.vnni:
            xb = gemm_lowbit_vnni4.x_bytes(spec, tiles.kp)
            praw, planes = aligned_malloc(body, b.mul(rows, const(i64, xb + gemm_lowbit_vnni.HEAD)))
            heads = simd.gep(b, planes, b.mul(rows, const(i64, xb)), i8)
            if spec.bits == 8:
                gemm_lowbit_vnni.emit_planes(body, spec.k, spec.dtype, x, planes, heads, rows)
            else:   # int4 takes them for a lone x row
                with body.if_(b.icmp_unsigned("==", rows, const(i64, 1))):
                    gemm_lowbit_vnni4.emit_planes(body, spec.k, tiles.kp, spec.dtype, x,
                                                  planes, heads, rows, spec.digits)
        wrow = tiles.kp if spec.bits == 8 else tiles.kp // 2     # bytes a W row
        with body.for_range(begin, end, name="blk") as blk:
            r0 = b.mul(blk, const(i64, rr))
            _block(body, spec, tiles, xbuf, (planes, heads), w, scale, zp, sums, tsums, rows,
                   r0, n0, n1, wrow, foldable)
        _epilogue(body, spec, L, sums, rows, n0, n1, bias, res, out)
        free = intrinsic(module, "free", void, [ptr])
        b.call(free, [xraw])
        b.call(free, [sraw])
        if spec.vnni:
            b.call(free, [praw])
    body.finish()
    args = [ptr] * 7 + ([] if spec.m else [i64])
    cap = max(1, n * spec.k // GRAIN)
    omp.emit_parallel(module, spec.symbol, args, body.fn, max_threads=min(cap, blocks))
    return module


def tile_rows(spec) -> int:
    """W rows a tile takes: its whole block, but half a block of int4 under tiles of several x
    rows. int4 weights are packed once, in blocks of ``rr`` = 8 rows, for a model's decode,
    prefill and dynamic-rows kernels alike (the last once packed blocks of 4 of their own: GPT-2
    int4 held two copies, 124 MB for 62), and 2-4 x rows times 8 W rows would not fit the
    registers."""
    if spec.bits == 4 and spec.mr > 1 and spec.rr % 2 == 0 and spec.rr > 4:
        return spec.rr // 2
    return spec.rr


def _block(f: Fn, spec, tiles: _Tile, xbuf, planes, w, scale, zp, sums, tsums, rows, r0, n0,
           n1, wrow: int, foldable) -> None:
    """W rows ``r0 .. r0 + rr`` (fewer in the last block) against every x row tile (with
    ``spec.vnni``: every x row, on its planes unless it must take the float path; with
    ``tiles.fold``: on the folded tiles where ``foldable``, else the exact ones)."""
    b, rr, mr, n = f.b, spec.rr, spec.mr, spec.n
    wp = simd.gep(b, w, b.mul(r0, const(i64, wrow)), i8)
    sp = simd.gep(b, scale, b.mul(r0, const(i64, tiles.ng)))
    zpp = simd.gep(b, zp, b.mul(r0, const(i64, tiles.ng)), i8)
    width = b.sub(n1, n0)
    col = b.sub(r0, n0)

    def _planes_of(i):
        """(planes, head) of x row ``i``."""
        xb = gemm_lowbit_vnni4.x_bytes(spec, tiles.kp)
        return (simd.gep(b, planes[0], b.mul(i, const(i64, xb)), i8),
                simd.gep(b, planes[1], b.mul(i, const(i64, gemm_lowbit_vnni.HEAD)), i8))

    def run(rows_here: int, w_rows: int, i0, kind=None, exact=False, h: int = 0):
        """x rows ``i0 ..`` against the block's W rows ``h .. h + w_rows``."""
        fn = tiles.get(kind or rows_here, w_rows, exact)
        if kind:
            f.call(fn, *_planes_of(i0), wp, sp, zpp if spec.bits == 4 else
                   simd.gep(b, zp, r0, i32), tsums)
        else:
            xp = simd.gep(b, xbuf, b.mul(i0, const(i64, tiles.xstride)))
            # an int4 chunk holds the block's rows one vector (L words) each
            f.call(fn, xp, simd.gep(b, wp, const(i64, h * tiles.L * 4), i8),
                   simd.gep(b, sp, const(i64, h * tiles.ng)),
                   simd.gep(b, zpp, const(i64, h * tiles.ng), i8), tsums)
        for i in range(rows_here):
            dst = b.add(b.add(b.mul(b.add(i0, const(i64, i)), width), col), const(i64, h))
            for r in range(w_rows):
                v = simd.load_scalar(b, tsums, const(i64, i * w_rows + r))
                simd.store_scalar(b, v, sums, b.add(dst, const(i64, r)))

    def by_rows(w_rows: int):
        """The block's ``w_rows`` W rows, in parts of ``tile_rows(spec)``."""
        step = tile_rows(spec)
        for h in range(0, w_rows, step):
            by_part(min(step, w_rows - h), h)

    def by_part(w_rows: int, h: int):
        if foldable is not None:
            with f.if_else(foldable, likely=True) as (folded, unfolded):
                with folded:
                    by_rows_of(w_rows, False, h)
                with unfolded:
                    by_rows_of(w_rows, True, h)
        else:
            by_rows_of(w_rows, False, h)

    def by_planes(w_rows: int, kind: str):
        with f.for_range(0, rows, name="xi") as i:
            head = _planes_of(i)[1]
            with f.if_else(gemm_lowbit_vnni.is_ready(b, head), likely=True) as (ints, floats):
                with ints:
                    if spec.digits == 2:   # int4: two digits where the row's are fine enough
                        with f.if_else(gemm_lowbit_vnni.is_fine(b, head), likely=True) as (
                                two, three):
                            with two:
                                run(1, w_rows, i, "vnni2")
                            with three:
                                run(1, w_rows, i, kind)
                    else:
                        run(1, w_rows, i, kind)
                with floats:
                    run(1, w_rows, i)

    def by_rows_of(w_rows: int, exact: bool, h: int):
        if spec.vnni and spec.bits == 8:  # a lone x row streams its W rows; several share
            # each plane load (int8 in place: whole blocks, h == 0)
            if spec.m:
                by_planes(w_rows, "vnnis" if spec.m == 1 else "vnni")
                return
            with f.if_else(b.icmp_unsigned("==", rows, const(i64, 1))) as (one, several):
                with one:
                    by_planes(w_rows, "vnnis")
                with several:
                    by_planes(w_rows, "vnni")
            return
        full = b.udiv(rows, const(i64, mr))
        with f.for_range(0, full, name="xt") as t:
            run(mr, w_rows, b.mul(t, const(i64, mr)), exact=exact, h=h)
        left = b.urem(rows, const(i64, mr))
        i0 = b.mul(full, const(i64, mr))
        for count in range(1, mr):
            if spec.m and spec.m % mr != count:
                continue
            with f.if_(b.icmp_unsigned("==", left, const(i64, count))):
                run(count, w_rows, i0, exact=exact, h=h)

    def each(w_rows: int):
        """int4 with ``spec.vnni``: a lone x row on vpdpbusd (its block's chunks one stream),
        several on the float tiles."""
        if not (spec.vnni and spec.bits == 4):
            by_rows(w_rows)
        elif spec.m == 1:
            by_planes(w_rows, "vnni")
        else:
            with f.if_else(b.icmp_unsigned("==", rows, const(i64, 1))) as (one, several):
                with one:
                    by_planes(w_rows, "vnni")
                with several:
                    by_rows(w_rows)

    edge = n % rr
    if edge:
        is_edge = b.icmp_signed("==", r0, const(i64, n - edge))
        with f.if_else(is_edge) as (last, whole):
            with last:
                each(edge)
            with whole:
                each(rr)
    else:
        each(rr)
