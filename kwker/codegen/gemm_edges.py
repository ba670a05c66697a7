"""Edge tiles of the GEMM loop nest (gemm.py): the micro-kernel variant for a tile at the row
and column edges, the run-time row count's switch over variants, and the small-M schedule of a
generic kernel with packed weights (up to ``small_rows`` rows: one tile of all rows per panel).
``p`` is gemm.py's plan of the product."""
from __future__ import annotations

from llvmlite import ir

from . import omp, simd
from .gemm_micro import FIRST, LAST, emit_micro
from .irutil import Fn, const, i64


def emit_small_rows(f: Fn, p, m_rows, ptrs, acc, tid, nt) -> None:
    """M <= ``small_rows`` rows against packed weights: one tile of all rows per panel, A read in
    place, K in one block, the panels split between the threads."""
    b, s = f.b, p.s
    a_mat, w, bias, res, c = ptrs
    variants = {(r, cols): emit_micro(f.module, p.micro(r, cols, in_place=True))
                for r in range(1, p.small_rows + 1) for cols in {s.nr, p.nr_edge}}
    lo, hi = omp.split(f, p.np, tid, nt)
    first_last = const(i64, FIRST | LAST)
    with f.for_range(lo, hi, name="q") as q:
        col = b.mul(q, const(i64, s.nr))
        c_tile = simd.gep(b, c, col, p.out_t)
        r_tile = simd.gep(b, res, col, p.out_t) if s.residual else res
        bias_t = simd.gep(b, bias, col) if s.bias else bias
        w_tile = simd.gep(b, w, b.mul(q, const(i64, p.kw_panel * s.nr)))
        args = [a_mat, w_tile, acc if p.bf16 else c_tile, const(i64, p.kw), first_last, bias_t,
                r_tile] + ([c_tile] if p.bf16 else [])

        def by_cols(rows):
            if p.nr_edge == s.nr:
                b.call(variants[rows, s.nr], args)
                return
            with f.if_else(b.icmp_signed("==", q, const(i64, p.np - 1))) as (edge, full):
                with edge:
                    b.call(variants[rows, p.nr_edge], args)
                with full:
                    b.call(variants[rows, s.nr], args)
        switch_rows(f, p.small_rows, m_rows, by_cols)


def dispatch(f: Fn, p, variants: dict, t, q, args, mt, m_rows) -> None:
    """Call the micro-kernel variant for tile (t, q): full, or specialised to the edges."""
    b, s = f.b, p.s
    row_edge = p.dyn_m or p.mr_edge != s.mr
    col_edge = p.nr_edge != s.nr
    if not row_edge and not col_edge:
        b.call(variants[s.mr, s.nr], args)
        return
    last_t = b.icmp_signed("==", t, b.sub(mt, const(i64, 1))) if row_edge else None
    last_q = b.icmp_signed("==", q, const(i64, p.np - 1)) if col_edge else None

    def by_cols(rows):
        if last_q is None:
            b.call(variants[rows, s.nr], args)
            return
        with f.if_else(last_q) as (edge, full):
            with edge:
                b.call(variants[rows, p.nr_edge], args)
            with full:
                b.call(variants[rows, s.nr], args)

    if last_t is None:
        by_cols(s.mr)
        return
    with f.if_else(last_t) as (edge, full):
        with edge:
            if p.dyn_m:
                switch_rows(f, s.mr, b.sub(m_rows, b.mul(t, const(i64, s.mr))), by_cols)
            else:
                by_cols(p.mr_edge)
        with full:
            by_cols(s.mr)


def switch_rows(f: Fn, most: int, rows: ir.Value, by_cols) -> None:
    """``by_cols(r)`` for the run-time row count ``rows`` (1..most)."""
    b = f.b
    done = b.append_basic_block("rows.done")
    full = b.append_basic_block("rows.full")
    sw = b.switch(rows, full)
    for r in range(1, most):
        block = b.append_basic_block(f"rows.{r}")
        sw.add_case(const(i64, r), block)
        b.position_at_end(block)
        by_cols(r)
        b.branch(done)
    b.position_at_end(full)
    by_cols(most)
    b.branch(done)
    b.position_at_end(done)
