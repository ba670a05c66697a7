"""GEMM ``C = act(A @ B + bias) + residual``: BLIS loop nest around the register micro-kernel.

Operands (all float32, row-major, shapes baked into the spec):
    A (batch, m, k); C and residual (batch, m, n); bias (n,);
    B is one of ``packed`` (weights pre-packed by the factory into ``nr``-wide k-major panels,
    zero-padded, shared by the batch), ``kn`` (runtime (batch, k, n)) or ``nk`` (runtime
    (batch, n, k), i.e. ``A @ B.T``).

Loops per thread (BLIS names; N is the vector dimension here, so the roles of BLIS's A and B
swap): ``jc`` chunks of ``mc`` rows of A; ``pc`` K blocks of ``kc`` (A chunk packed into
micro-panels, L2/L3); ``ic`` blocks of ``nb`` panels of B (the L2 block; runtime B is packed here,
pre-packed weights are used in place); ``jr`` row tiles (one A micro-panel, L1); ``ir`` panels;
micro-kernel. Edge tiles use micro-kernel variants specialised to the leftover rows/columns.

Threads split the batch, or else the M tiles or the N panels (whichever has enough work; N when
B is packed at run time, so no two threads pack the same panels, and for pre-packed weights of
more columns than rows, unless on the tiles the rows are many: ``_rows_outweigh``), never K:
each C tile is owned by one thread, so the K blocks accumulate without synchronisation and the
epilogue runs once, on the last K block. Pre-packed panels are split by work, in (panel, row
tile) units weighted by their vectors, so the narrow edge panel does not leave a thread idle: a
boundary may fall inside a panel, whose row tiles the two threads then share (1024 columns in
48-wide panels: 11 and 10 1/3 panels, 3% idle, before).

bfloat16 (``dtype="bf16"``): A, B, the residual and C are bf16, the bias float32. The loop nest
is the float32 one over k *pairs* (32-bit words of two bf16, see gemm_micro.py), so blocking,
packing of A and of a transposed B are the float32 routines moving words; a row-major runtime B
is interleaved in pairs while it is packed (``pack_cols(pairs=True)``). K must be even (the
factories pad an odd K with one zero column). Partial sums of earlier K blocks live in a float32
scratch chunk per thread, so C is written once, rounded once.

Generic sizes (``m == 0``, and ``batch == 0`` for a runtime B): the row count and the batch are
read at call time, passed after the five pointers, so one kernel serves every batch size and
sequence length. The row edge then is a run-time count: the edge tile switches over micro-kernel
variants for every count 1..mr-1 (few-row variants keep ``ksplit`` accumulator sets, so M=1 still
has FMA chains in flight). What varies never changes the blocking, chosen from N and K. With
packed weights, up to ``SMALL_ROWS`` rows take the small-M schedule in the same panels (one tile
of all rows, A read in place, K unblocked: 61 -> 45 us at M=1 for 2048x512, one thread), so a
generic kernel serves decode-sized batches nearly as fast as a specialised one.

``a_pack=False`` broadcasts A in place and does not block K. The factory picks it for small M
(decode shapes: one tile holds all rows, the weights stream once at memory bandwidth, with
``ksplit`` accumulator sets for enough FMA chains) and for a runtime B only one or two panels
wide (each A row is used once or twice: packing it would cost as much as the product).

Low-bit B (``b_bits``: a transposed B, on the vector path or the bf16 tiles, as the weight-only
int8 / int4 linears' prefill uses it): B is int8 or int4 W rows in gemm_lowbit.py's layout, its
float32 scales and int8 zero points two more pointers after the five. Where a runtime B is
packed (``ic``), each panel's rows are dequantised ``UNPACK_WORDS`` k words at a time into an L1
buffer (gemm_lowbit_unpack.emit_slice) and packed from there as a transposed B, so the product
never makes a float copy of the weights. int4 K blocks are whole chunks of the layout.
"""
from __future__ import annotations

from llvmlite import ir

from . import (
    bf16,
    gemm_lowbit,
    gemm_lowbit_unpack,
    gemm_lowbit_vnni,
    gemm_tile,
    gemm_tile_grouped,
    omp,
    simd,
)
from .gemm_edges import dispatch, emit_small_rows
from .gemm_micro import FIRST, LAST, Micro, emit_micro
from .gemm_pack import emit_pack_cols, emit_pack_rows
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
    smin,
)

MIN_FLOPS_PER_THREAD = 1 << 18  # ~2.5 us of FMAs: a fork (~1 us) pays off above it
# pre-packed weights are streamed from memory once a call: a thread per this many bytes of them
# (~3 us of a streaming read) pays off too, however few the FLOPs (a decode row's GEMV)
MIN_WEIGHT_BYTES_PER_THREAD = 1 << 16
SMALL_ROWS = 8  # generic over M with packed weights: up to this many rows, the small-M schedule
UNPACK_WORDS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Plan:
    """Compile-time facts the emitter needs, derived from the spec and the target."""

    def __init__(self, spec, target):
        self.s, self.target = spec, target
        self.lanes = simd.float_lanes(target)
        if spec.nr % self.lanes:
            raise ValueError(f"kwker gemm: nr={spec.nr} not a multiple of {self.lanes} lanes")
        self.bf16 = spec.dtype == "bf16"
        self.int8 = spec.dtype == "u8s8"   # tile path only: see gemm_tile.py
        per_word = {"f32": 1, "bf16": 2, "u8s8": 4}.get(spec.dtype)
        self.lowbit = spec.b_bits != 0
        if per_word is None or spec.k % per_word and not (self.lowbit and self.bf16):
            raise ValueError(f"kwker gemm: dtype {spec.dtype!r} with k={spec.k} (bf16 needs "
                             "an even k, u8s8 a multiple of 4)")
        self.per_word = per_word
        self.dot = "fma"
        if self.bf16:
            self.dot = "dpbf16" if bf16.native(target) else "widen"
        if self.int8:
            self.dot = "vnni"
        self.kw = -(-spec.k // per_word)  # k steps of A and B (32-bit words)
        self.tiles = spec.path == "tile"
        self.tile_mode = target.tiles
        if self.tiles and (spec.dtype == "f32" or target.tiles not in ("amx", "emulated")
                           or (spec.mr, spec.nr) != gemm_tile.TILE_BLOCK):
            raise ValueError(f"kwker gemm: the tile path needs bf16 or u8s8, a target with "
                             f"tiles (this one: {target.tiles or 'none'}) and a "
                             f"{gemm_tile.TILE_BLOCK} block, not {spec.dtype} "
                             f"{spec.mr}x{spec.nr}")
        vnni = self.lanes == 16 and target.has("avx512vnni")
        self.planes = spec.planes
        if self.int8 and not ((self.tiles or vnni) and spec.b_layout == "packed" and
                              (not spec.residual or self.planes)):
            raise ValueError("kwker gemm: u8s8 runs on the tile path or on a CPU with "
                             "AVX512_VNNI, with packed weights and no residual")
        if self.planes and not (self.int8 and spec.batch == 1 and spec.planes in (2, 3) and (
                spec.mr % spec.planes == 0 or self.tiles)):
            raise ValueError(f"kwker gemm: byte planes ({spec.planes}) are u8s8, one batch, "
                             f"tiles of whole x rows (mr={spec.mr})")
        # rows of A a row tile takes: on the tiles, whole x rows' planes of a 32-row block (30
        # of 3 planes, the last two rows zero), so the epilogue can combine them
        self.a_rows = spec.mr // spec.planes * spec.planes if self.tiles and self.planes \
            else spec.mr
        self.out_rows = self.a_rows // (self.planes or 1)   # rows of C a row tile writes
        self.ldo = spec.ldo or spec.n             # planes: the output's row stride
        # planes against grouped panels (int4): b_group is the k of a scale, a multiple of
        # their 32 k a group (more than one group only on the tiles, gemm_tile_grouped.py)
        self.grouped = bool(self.planes and spec.b_group)
        group = 4 * gemm_lowbit_vnni.GROUP_QUADS
        if self.grouped and (spec.b_group % group or spec.b_group != group and not self.tiles):
            raise ValueError(f"kwker gemm: grouped panels take {group} k a scale (on the tiles "
                             f"a multiple of {group}), not {spec.b_group}")
        if spec.plane_bits != 8 and not (spec.plane_bits == 12 and self.grouped and self.tiles
                                         and spec.planes == 2):
            raise ValueError(f"kwker gemm: {spec.plane_bits}-bit planes are two, against "
                             "grouped panels on the tiles")
        if spec.out not in ("", spec.dtype) and not (
                spec.out == "f32" and self.bf16 and spec.b_layout in ("packed", "nk")):
            raise ValueError(f"kwker gemm: a {spec.out} output is for bf16 packed or "
                             f"transposed weights, not {spec.dtype} with a {spec.b_layout} B")
        self.out = spec.out or ("f32" if self.int8 else spec.dtype)  # out and residual type
        self.out_t = i16 if self.out == "bf16" else f32
        # k words of one pre-packed panel: the tile path pads K to whole tiles with zeros
        # (int8 panels are always made for the tiles: lowbit_panels)
        self.kw_panel = gemm_tile.padded_k(self.kw) if self.tiles or self.int8 else self.kw
        self.dyn_m, self.dyn_batch = spec.m == 0, spec.batch == 0
        if self.dyn_batch and spec.b_layout == "packed":
            raise ValueError("kwker gemm: a runtime batch needs a runtime B (kn or nk)")
        self.np = _cdiv(spec.n, spec.nr)          # column panels
        if self.dyn_m:  # row tiles and the edge tile's rows are known at call time only
            self.mt = self.mr_edge = None
        else:
            self.mt = _cdiv(spec.m, self.a_rows)  # row tiles
            self.mr_edge = spec.m - (self.mt - 1) * self.a_rows
        self.nr_edge = spec.n - (self.np - 1) * spec.nr
        self.kc = self.kw if not spec.a_pack else min(spec.kc, self.kw)
        # pre-packed weights streamed from memory are prefetched on AVX-512 (gemm_micro.py)
        self.prefetch = simd.STREAM_AHEAD if self.lanes == 16 else 0
        self.weights = self._lowbit_weights(target) if self.lowbit else None
        # k words of a low-bit B dequantised at a time, then packed: whole int4 chunks, and a
        # panel's 32 rows of them (8 KB) stay in L1 (all of a K block, 48 KB at K = 768 in
        # bf16, filled L1 and went through L2)
        self.unpack_words = min(self.kc, max(
            UNPACK_WORDS, gemm_lowbit.chunk(spec.b_bits, self.lanes) // per_word)) \
            if self.lowbit else 0
        self.n_ptrs = 7 if self.lowbit else 8 if self.planes else 5
        self.pack_b = spec.b_layout == "nk" or (spec.b_layout == "kn" and
                                                 (spec.a_pack or self.bf16))
        self.one_block = self.kc >= self.kw
        self.small = self.dyn_m and spec.b_layout == "packed" and spec.a_pack and not self.int8
        self.small_rows = min(gemm_tile.VECTOR_ROWS if self.tiles else SMALL_ROWS, spec.mr)
        # without packing a chunk is only a loop bound: 64 tiles when M is not known
        self.tiles_per_chunk = (max(1, spec.mc // spec.mr) if spec.a_pack else
                                self.mt or 64)

    def _lowbit_weights(self, target) -> gemm_lowbit_unpack.WeightFormat:
        """The low-bit B's format (GemmSpec.b_bits), checked against what this nest can do."""
        s = self.s
        if s.b_layout != "nk" or self.int8 or s.batch != 1 or s.b_bits not in (4, 8):
            raise ValueError(f"kwker gemm: low-bit weights (b_bits={s.b_bits}) are a "
                             f"transposed B of one batch, in f32 or bf16")
        fmt = gemm_lowbit_unpack.WeightFormat(s.b_bits, s.k, s.b_group, s.b_zp, s.b_rr,
                                              s.dtype)
        gemm_lowbit.check_format(fmt, self.lanes)
        c = gemm_lowbit.chunk(s.b_bits, self.lanes)
        if s.b_bits == 4 and s.b_lanes != self.lanes:
            raise ValueError(f"kwker gemm: int4 weights packed for {s.b_lanes} lanes, the "
                             f"target has {self.lanes}")
        if self.kc < self.kw and (self.kc * self.per_word) % c:
            raise ValueError(f"kwker gemm: K blocks of {self.kc} words split the weights' "
                             f"steps of {c}")
        return fmt

    def edge_rows(self) -> list[int]:
        """Row counts that need their own micro-kernel variant."""
        if self.dyn_m:
            return list(range(1, self.s.mr + 1))
        return sorted({self.s.mr, self.mr_edge})

    def micro(self, rows: int, cols: int, in_place: bool = False) -> Micro:
        """The variant for a ``rows`` x ``cols`` tile; ``in_place``: the small-M schedule's
        (A read where it is, K in one block)."""
        s, L = self.s, self.lanes
        nv = _cdiv(cols, L)
        if in_place:
            a_rs, a_ks = self.kw, 1
        elif s.a_pack:
            a_rs, a_ks = 1, s.mr
        else:
            a_rs, a_ks = self.kw, 1
        if self.pack_b or s.b_layout == "packed":
            ldb, masked = s.nr, False
        else:
            ldb, masked = s.n, True
        # bf16 (and planes) partial sums: a scratch tile (one K block) or a scratch chunk of
        # full rows
        scratch = self.bf16 or self.planes
        ldc = s.n if not scratch or not (self.one_block or in_place) else s.nr
        ksplit = s.ksplit
        if self.dyn_m and rows < s.mr and not self.grouped:  # few rows: more FMA chains
            ksplit = max(ksplit, 1 << max(0, min(2, (8 // (rows * nv)).bit_length() - 1)))
        return Micro(rows, nv, L, cols, a_rs, a_ks, ldb, masked, ldc, s.epilogue, s.bias,
                     s.residual, ksplit, s.unroll, self.dot,
                     s.n if self.bf16 else self.ldo if self.planes else 0,
                     out="" if self.out == s.dtype else self.out,
                     bias_at=self.np * s.nr if self.int8 and s.bias and not self.planes else 0,
                     planes=self.planes, grouped=self.grouped,
                     prefetch=self.prefetch if s.b_layout == "packed" else 0)

    def sizes(self, f: Fn, ctx) -> tuple:
        """(M, batch, row tiles) as IR values: constants, or read from the call's arguments."""
        b, s = f.b, self.s
        slot = self.n_ptrs
        if self.dyn_m:
            m = ctx.i64(slot)
            slot += 1
            mt = self.row_tiles(b, m)
        else:
            m, mt = const(i64, s.m), const(i64, self.mt)
        batch = ctx.i64(slot) if self.dyn_batch else const(i64, s.batch)
        return m, batch, mt

    def row_tiles(self, b: ir.IRBuilder, m: ir.Value) -> ir.Value:
        """ceil(m / rows a tile) for a row count known at call time."""
        return b.sdiv(b.add(m, const(i64, self.a_rows - 1)), const(i64, self.a_rows))

    def panel_rows(self, k, b: ir.IRBuilder | None = None):
        """Rows of a pre-packed panel before k word ``k`` (an int, or an IR value with ``b``):
        ``k``, or with grouped panels the group rows too."""
        if not self.grouped:
            return k
        rows = gemm_tile_grouped.group_rows(self.s.plane_bits)
        quads = gemm_tile_grouped.group_words(self.s.plane_bits)
        if b is None:
            return k // quads * rows
        return b.mul(b.udiv(k, const(i64, quads)), const(i64, rows))

    @property
    def int_args(self) -> int:
        return int(self.dyn_m) + int(self.dyn_batch)


def emit(spec, target) -> ir.Module:
    p = _Plan(spec, target)
    module = new_module(spec.symbol)
    body = _emit_body(module, p)
    args = [ptr] * p.n_ptrs + [i64] * p.int_args
    if p.int_args:
        omp.emit_parallel(module, spec.symbol, args, body,
                          max_threads=lambda b, a: _max_threads_at_run_time(b, p, a[p.n_ptrs:]))
        return module
    flops = 2 * spec.batch * spec.m * spec.n * spec.k
    units = spec.batch * max(p.mt, p.np)
    max_threads = max(1, min(units, max(flops // MIN_FLOPS_PER_THREAD, _weight_work(p))))
    omp.emit_parallel(module, spec.symbol, args, body, max_threads=max_threads)
    return module


def _max_threads_at_run_time(b: ir.IRBuilder, p: _Plan, ints: list) -> ir.Value:
    """The static rule (enough work units, ~2.5 us of FMAs per thread) on the call's sizes."""
    s = p.s
    m = ints[0] if p.dyn_m else const(i64, s.m)
    batch = ints[-1] if p.dyn_batch else const(i64, s.batch)
    mt = p.row_tiles(b, m)
    units = b.mul(batch, b.select(b.icmp_signed(">", mt, const(i64, p.np)), mt,
                                  const(i64, p.np)))
    work = b.sdiv(b.mul(b.mul(batch, m), const(i64, 2 * s.n * s.k)),
                  const(i64, MIN_FLOPS_PER_THREAD))
    weights = const(i64, _weight_work(p))
    work = b.select(b.icmp_signed(">", work, weights), work, weights)
    cap = b.select(b.icmp_signed("<", units, work), units, work)
    return b.select(b.icmp_signed("<", cap, const(i64, 1)), const(i64, 1), cap)


def _weight_work(p: _Plan) -> int:
    """Threads the streaming of pre-packed weights alone keeps busy (0 for a runtime B)."""
    if p.s.b_layout != "packed":
        return 0
    per = {"f32": 4, "bf16": 2, "u8s8": 1}[p.s.dtype]
    return p.s.n * p.s.k * per // MIN_WEIGHT_BYTES_PER_THREAD


def _rows_outweigh(f: Fn, p, mt, nt, m_rows) -> ir.Value:
    """On the tiles, whether threads split the rows though they are fewer than the columns:
    a thread of an N split packs all of A, one of an M split streams all of B, and with 8 row
    tiles a thread or more and at least a quarter as many rows as columns the copies of A cost
    more (Xeon with AMX, bf16, 2 threads, the median of 4 trials in one process, two runs:
    512 x 768 x 3072 11.4-12.6% faster, 1024 x 3072 x 768 2.9-4.6%, 2048 x 4096 x 1024 3.0-4.0%,
    512 x 2048 x 2048 2.3%, 1024 x 4096 x 4096 2.3%; with 8 row tiles in all, 256 x 1024 x 1024
    to 256 x 4096 x 1024, 3.6-5.8% slower split by rows; float32 on the vector path within 2%
    either way). bf16 products of bf16 weights only: low-bit weights unpacked into panels per
    call would be unpacked whole by each thread, and the int4 prefill's grouped byte planes
    measured 5.6% slower at 512 x 3072 x 768 split by rows (int8 level)."""
    b = f.b
    return b.and_(b.icmp_signed(">=", mt, b.mul(nt, const(i64, 8))),
                  b.icmp_signed(">=", b.mul(m_rows, const(i64, 4)), const(i64, p.s.n)))


def _work_bound(f: Fn, p: _Plan, mt, k, nt) -> ir.Value:
    """The first (panel, row tile) unit of thread ``k`` of ``nt`` (``k = nt``: the end) when
    pre-packed panels are split by work: a full panel's tile weighs its ``nv`` vectors, the
    edge panel's its own count. A boundary goes to the nearest unit edge, not the one below: with
    two units of 4 and 3 vectors the first thread takes one, where rounding down gave the second
    thread both."""
    b = f.b
    nv, nv_edge = p.s.nr // p.lanes, _cdiv(p.nr_edge, p.lanes)
    full_units = b.mul(mt, const(i64, p.np - 1))
    total = b.add(b.mul(full_units, const(i64, nv)), b.mul(mt, const(i64, nv_edge)))
    work = b.sdiv(b.mul(total, k), nt)
    full_work = b.mul(full_units, const(i64, nv))
    past = b.add(full_units, b.sdiv(b.add(b.sub(work, full_work), const(i64, nv_edge // 2)),
                                     const(i64, nv_edge)))
    within = b.sdiv(b.add(work, const(i64, nv // 2)), const(i64, nv))
    return b.select(b.icmp_signed("<", work, full_work), within, past)


def _emit_body(module: ir.Module, p: _Plan) -> ir.Function:
    s = p.s
    f = omp.body_fn(module, f"{s.symbol}.body")
    ctx = omp.Context(f, f.args[0])
    tid, nt = f.args[1], f.args[2]
    b = f.b
    a_all, b_all, bias, res_all, c_all = (ctx.ptr(i) for i in range(5))
    quant = (ctx.ptr(5), ctx.ptr(6)) if p.lowbit else None  # the low-bit B's scales, zps
    if p.planes:  # the x rows' heads, the columns' scales and sums of q
        quant = (ctx.ptr(5), ctx.ptr(6), ctx.ptr(7))
    m_rows, n_batch, mt = p.sizes(f, ctx)

    # -- who does what: batch items, else row tiles or column panels -------------------------
    t0, t1 = f.var(i64, const(i64, 0)), f.var(i64, mt)
    q0, q1 = f.var(i64, const(i64, 0)), f.var(i64, const(i64, p.np))
    # this thread's (panel q, row tile t) units u = q * mt + t, in [u0, u1)
    u0, u1 = f.var(i64, const(i64, 0)), f.var(i64, b.mul(mt, const(i64, p.np)))
    bt0, bt1 = f.var(i64, const(i64, 0)), f.var(i64, n_batch)
    with f.if_else(b.icmp_signed(">=", n_batch, nt)) as (by_batch, inside):
        with by_batch:
            lo, hi = omp.split(f, n_batch, tid, nt)
            bt0.set(lo)
            bt1.set(hi)
        with inside:
            # a runtime B is packed by every thread that uses it: split N when there is enough
            rows_enough = b.icmp_signed(">=", mt, b.mul(nt, const(i64, 4)))
            if p.pack_b:
                rows_enough = const(ir.IntType(1), 0)
            elif s.b_layout == "packed" and (p.dyn_m or s.m < s.n):
                # fewer rows than weight columns: splitting rows makes every thread stream all
                # the weights (from DRAM once they outgrow the cache); split N when it has
                # enough panels (MLP 1024-4096-1024 b64 in bf16: 2.95 -> 2.5 ms)
                many_panels = b.icmp_signed(">=", const(i64, p.np), b.mul(nt, const(i64, 4)))
                if p.dyn_m:
                    many_panels = b.and_(many_panels, b.icmp_signed("<", m_rows,
                                                                    const(i64, s.n)))
                if p.tiles and p.bf16 and not p.lowbit:
                    many_panels = b.and_(many_panels, b.not_(_rows_outweigh(f, p, mt, nt,
                                                                            m_rows)))
                rows_enough = b.and_(rows_enough, b.not_(many_panels))
            few_panels = b.icmp_signed("<", const(i64, p.np), nt)
            with f.if_else(b.or_(rows_enough, few_panels)) as (by_rows, by_cols):
                with by_rows:
                    lo, hi = omp.split(f, mt, tid, nt)
                    t0.set(lo)
                    t1.set(hi)
                with by_cols:
                    if s.b_layout == "packed" and not p.pack_b:
                        lo = _work_bound(f, p, mt, tid, nt)
                        hi = _work_bound(f, p, mt, b.add(tid, const(i64, 1)), nt)
                        u0.set(lo)
                        u1.set(hi)
                        q0.set(b.sdiv(lo, mt))
                        q1.set(b.sdiv(b.add(hi, b.sub(mt, const(i64, 1))), mt))
                    else:
                        lo, hi = omp.split(f, p.np, tid, nt)
                        q0.set(lo)
                        q1.set(hi)

    free = intrinsic(module, "free", ir.VoidType(), [ptr])
    ptrs = (a_all, b_all, bias, res_all, c_all)
    split = (bt0, bt1, t0, t1, q0, q1, u0, u1)
    raws = []
    if p.lowbit:  # one panel's rows dequantised, before they are packed
        raw, rows_buf = aligned_malloc(f, s.nr * p.unpack_words * 4)
        raws.append(raw)
        quant = quant + (rows_buf,)
    if p.tiles:
        tile_raws, bufs = gemm_tile.allocate(f, p)
        raws += tile_raws
        acc = bufs[-1]
    else:
        ap = bp = acc = None
        if s.a_pack:
            raw, ap = aligned_malloc(f, s.mc * p.kc * 4)
            raws.append(raw)
        if p.pack_b:
            raw, bp = aligned_malloc(f, s.nb * s.nr * p.kc * 4)
            raws.append(raw)
        if p.bf16 or p.planes:
            rows = s.mr if p.one_block else p.tiles_per_chunk * s.mr
            raw, acc = aligned_malloc(f, rows * (s.nr if p.one_block else s.n) * 4)
            raws.append(raw)
        bufs = (ap, bp, acc)

    if p.small:
        with f.if_(b.icmp_signed("<=", m_rows, const(i64, p.small_rows))):
            emit_small_rows(f, p, m_rows, ptrs, acc, tid, nt)
            bt1.set(bt0.get())  # the blocked loop nest below has nothing left to do

    if p.tiles:
        gemm_tile.emit_nest(f, p, ptrs, m_rows, n_batch, mt, split, bufs, quant,
                            _lowbit_packer(module, p))
    else:
        _emit_vector_nest(f, p, ptrs, m_rows, n_batch, mt, split, bufs, quant)
    for raw in raws:
        b.call(free, [raw])
    return f.finish()


def _emit_vector_nest(f: Fn, p: _Plan, ptrs, m_rows, n_batch, mt, split, bufs,
                      quant=None) -> None:
    """The BLIS loop nest around the register micro-kernels (module doc); ``quant``: a
    low-bit B's (scales, zero points, row buffer)."""
    s, L, b, module = p.s, p.lanes, f.b, f.module
    a_all, b_all, bias, res_all, c_all = ptrs
    bt0, bt1, t0, t1, q0, q1, u0, u1 = split
    ap, bp, acc = bufs
    variants = {}
    for rows in p.edge_rows():
        for cols in {s.nr, p.nr_edge}:
            variants[rows, cols] = emit_micro(module, p.micro(rows, cols))
    kw = p.kw
    pack_a = emit_pack_rows(module, s.mr, kw, L) if s.a_pack else None
    if p.lowbit:
        pack_lowbit = _lowbit_packer(module, p)
    elif s.b_layout == "nk":
        pack_b = emit_pack_rows(module, s.nr, kw, L)
    elif p.pack_b:
        pack_b = emit_pack_cols(module, s.nr, s.n, L, pairs=p.bf16)
    else:
        pack_b = None

    ct = i16 if p.bf16 else None  # element type of a runtime B
    ot = p.out_t  # of C and the residual

    def at(base, index, ty=None):
        return simd.gep(b, base, index, ty) if ty is not None else simd.gep(b, base, index)

    tiles_per_chunk = p.tiles_per_chunk
    with f.for_range(bt0.get(), bt1.get(), name="batch") as bi:
        a_mat = simd.gep(b, a_all, b.mul(b.mul(bi, m_rows), const(i64, kw)))
        mn = b.mul(b.mul(bi, m_rows), const(i64, s.n))
        c_mat = at(c_all, mn, ot)
        r_mat = at(res_all, mn, ot) if s.residual else res_all
        b_mat = b_all if s.b_layout == "packed" else \
            at(b_all, b.mul(bi, const(i64, s.k * s.n)), ct)
        with f.for_range(t0.get(), t1.get(), step=tiles_per_chunk, name="jc") as tc0:
            tc1 = b.add(tc0, const(i64, tiles_per_chunk))
            tc1 = b.select(b.icmp_signed("<", tc1, t1.get()), tc1, t1.get())
            row0 = b.mul(tc0, const(i64, s.mr))
            row1 = b.mul(tc1, const(i64, s.mr))
            row1 = b.select(b.icmp_signed("<", row1, m_rows), row1, m_rows)
            with f.for_range(0, kw, step=p.kc, name="pc") as k0:
                kcl = b.sub(const(i64, kw), k0)
                kcl = b.select(b.icmp_signed("<", kcl, const(i64, p.kc)), kcl, const(i64, p.kc))
                mode = b.or_(
                    b.select(b.icmp_signed("==", k0, const(i64, 0)), const(i64, FIRST),
                             const(i64, 0)),
                    b.select(b.icmp_signed("==", b.add(k0, kcl), const(i64, kw)),
                             const(i64, LAST), const(i64, 0)))
                if s.a_pack:
                    src = simd.gep(b, a_mat, b.add(b.mul(row0, const(i64, kw)), k0))
                    b.call(pack_a, [src, b.sub(row1, row0), kcl, ap])
                with f.for_range(q0.get(), q1.get(), step=s.nb, name="ic") as qb0:
                    qb1 = b.add(qb0, const(i64, s.nb))
                    qb1 = b.select(b.icmp_signed("<", qb1, q1.get()), qb1, q1.get())
                    if p.lowbit:
                        pack_lowbit(f, b_all, quant, qb0, qb1, k0, kcl, bp, kcl)
                    elif p.pack_b:
                        col0 = b.mul(qb0, const(i64, s.nr))
                        cols = b.sub(b.select(
                            b.icmp_signed("<", b.mul(qb1, const(i64, s.nr)), const(i64, s.n)),
                            b.mul(qb1, const(i64, s.nr)), const(i64, s.n)), col0)
                        if s.b_layout == "nk":
                            src = simd.gep(b, b_mat, b.add(b.mul(col0, const(i64, kw)), k0))
                        else:  # bf16: rows 2 k0 and 2 k0 + 1 start the first pair
                            krow = b.mul(k0, const(i64, 2)) if p.bf16 else k0
                            src = at(b_mat, b.add(b.mul(krow, const(i64, s.n)), col0), ct)
                        b.call(pack_b, [src, cols, kcl, bp])
                    with f.for_range(tc0, tc1, name="jr") as t:
                        if s.a_pack:
                            a_tile = simd.gep(b, ap, b.mul(b.sub(t, tc0),
                                                           b.mul(kcl, const(i64, s.mr))))
                        else:
                            a_tile = simd.gep(b, a_mat, b.add(
                                b.mul(t, const(i64, s.mr * kw)), k0))
                        row_off = b.mul(t, const(i64, s.mr * s.n))
                        with f.for_range(qb0, qb1, name="ir") as q:
                            if p.pack_b:
                                b_tile = simd.gep(b, bp, b.mul(b.sub(q, qb0),
                                                               b.mul(kcl, const(i64, s.nr))))
                            elif s.b_layout == "packed":
                                b_tile = simd.gep(b, b_mat, b.add(
                                    b.mul(q, const(i64, p.panel_rows(p.kw_panel) * s.nr)),
                                    b.mul(p.panel_rows(k0, b), const(i64, s.nr))))
                            else:
                                b_tile = simd.gep(b, b_mat, b.add(
                                    b.mul(k0, const(i64, s.n)), b.mul(q, const(i64, s.nr))))
                            off = b.add(row_off, b.mul(q, const(i64, s.nr)))
                            c_tile = at(c_mat, off, ot)
                            r_tile = at(r_mat, off, ot) if s.residual else r_mat
                            # (int8: the column scales sit where the bias would)
                            bias_t = simd.gep(b, bias, b.mul(q, const(i64, s.nr))) \
                                if s.bias or p.int8 and not p.planes else bias
                            args = [a_tile, b_tile, c_tile, kcl, mode, bias_t, r_tile]
                            if p.planes:
                                c_tile, r_tile, more = _planes_tile(f, p, c_mat, r_mat, quant,
                                                                    t, q)
                            if p.bf16 or p.planes:  # partial sums in the scratch, C apart
                                a_off = acc if p.one_block else simd.gep(b, acc, b.add(
                                    b.mul(b.sub(t, tc0), const(i64, s.mr * s.n)),
                                    b.mul(q, const(i64, s.nr))))
                                args = [a_tile, b_tile, a_off, kcl, mode, bias_t, r_tile,
                                        c_tile] + (more if p.planes else [])
                            unit = b.add(b.mul(q, mt), t)
                            with f.if_(b.and_(b.icmp_signed(">=", unit, u0.get()),
                                              b.icmp_signed("<", unit, u1.get()))):
                                dispatch(f, p, variants, t, q, args, mt, m_rows)


def _planes_tile(f: Fn, p: _Plan, c_mat, r_mat, quant, t, q) -> tuple:
    """(out tile, residual tile, [heads, scales, sums of q]) of tile (t, q) of byte planes:
    its ``mr / planes`` x rows, ``ldo`` apart."""
    b, s = f.b, p.s
    heads, scale, qsum = quant
    row = b.mul(t, const(i64, p.out_rows))
    col = b.mul(q, const(i64, s.nr))
    off = b.add(b.mul(row, const(i64, p.ldo)), col)
    res = simd.gep(b, r_mat, off, p.out_t) if s.residual else r_mat
    head = simd.gep(b, heads, b.mul(row, const(i64, gemm_lowbit_vnni.HEAD)), i8)
    return (simd.gep(b, c_mat, off, p.out_t), res,
            [head, simd.gep(b, scale, col), simd.gep(b, qsum, col, i32)])


def _lowbit_packer(module: ir.Module, p: _Plan):
    """``pack(f, w, quant, qb0, qb1, k0, kcl, bp, ld)``, or None without a low-bit B: panels
    ``qb0 .. qb1`` of the low-bit B over K block ``k0`` (``kcl`` words) into ``bp``, ``ld``
    words a panel row apart (the tile path: K padded to whole steps); each panel's W rows
    dequantised into the row buffer (L1), then packed as a transposed B is."""
    if not p.lowbit:
        return None
    s = p.s
    step = p.unpack_words
    unpack = gemm_lowbit_unpack.emit_slice(module, p.weights, p.target, step * p.per_word)
    pack_b = emit_pack_rows(module, s.nr, step, p.lanes)

    def pack(f: Fn, w, quant, qb0, qb1, k0, kcl, bp, ld) -> None:
        b = f.b
        scale, zp, rows_buf = quant
        pw = const(i64, p.per_word)
        with f.for_range(qb0, qb1, name="uq") as q:
            row0 = b.mul(q, const(i64, s.nr))
            rows = smin(b, b.sub(const(i64, s.n), row0), const(i64, s.nr))
            panel = simd.gep(b, bp, b.mul(b.sub(q, qb0), b.mul(ld, const(i64, s.nr))))
            with f.for_range(0, kcl, step=step, name="uk") as c:
                words = smin(b, b.sub(kcl, c), const(i64, step))
                ka = b.mul(b.add(k0, c), pw)     # k of the piece's first word
                kn = smin(b, b.sub(const(i64, s.k), ka), b.mul(words, pw))
                b.call(unpack, [w, scale, zp, row0, rows, ka, kn, rows_buf])
                b.call(pack_b, [rows_buf, rows, words,
                                simd.gep(b, panel, b.mul(c, const(i64, s.nr)))])
    return pack
