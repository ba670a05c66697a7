"""Row-parallel driver shared by the eager kernels.

Every eager kernel takes one argument: a pointer to a block of i64 slots. Slots 0-3 are common:

    0 nthreads   threads to use (1 runs on the calling thread, no fork/join)
    1 rows       independent rows to process
    2 scratch    base of per-thread scratch memory
    3 scratch_stride  bytes of scratch per thread

the rest belong to the op. Rows are split into contiguous chunks over torch's own OpenMP pool
(``GOMP_parallel`` from the libgomp torch loaded), so ``torch.set_num_threads`` applies and the
fork/join costs about 2 us.
"""
from __future__ import annotations

from llvmlite import ir

from .irutil import Fn, const, i32, i64, intrinsic, ptr, void

NTHREADS, ROWS, SCRATCH, SCRATCH_STRIDE = 0, 1, 2, 3
FIRST_OP_SLOT = 4


def emit_row_driver(module: ir.Module, symbol: str, row_fn: ir.Function) -> ir.Function:
    """Export ``symbol(ptr args)`` that runs ``row_fn(args, row, scratch)`` for every row."""
    gomp = intrinsic(module, "GOMP_parallel", void, [ptr, ptr, i32, i32])
    tnum = intrinsic(module, "omp_get_thread_num", i32, [])
    tcount = intrinsic(module, "omp_get_num_threads", i32, [])

    chunk = Fn(module, f"{symbol}.chunk", void, [ptr, i64, i64], ["args", "tid", "nt"])
    args, tid, nt = chunk.args
    b = chunk.b
    rows = chunk.arg_i64(args, ROWS)
    begin = b.sdiv(b.mul(rows, tid), nt)
    end = b.sdiv(b.mul(rows, b.add(tid, const(i64, 1))), nt)
    stride = chunk.arg_i64(args, SCRATCH_STRIDE)
    scratch = chunk.gep(chunk.arg_ptr(args, SCRATCH), b.mul(tid, stride), ir.IntType(8))
    with chunk.for_range(begin, end, name="row") as r:
        b.call(row_fn, [args, r, scratch])
    chunk.finish()

    body = Fn(module, f"{symbol}.omp", void, [ptr], ["args"])
    t = body.b.sext(body.b.call(tnum, []), i64)
    n = body.b.sext(body.b.call(tcount, []), i64)
    body.b.call(chunk.fn, [body.args[0], t, n])
    body.finish()

    main = Fn(module, symbol, void, [ptr], ["args"], internal=False)
    nthreads = main.arg_i64(main.args[0], NTHREADS)
    with main.if_else(main.b.icmp_signed("<=", nthreads, const(i64, 1))) as (serial, par):
        with serial:
            main.b.call(chunk.fn, [main.args[0], const(i64, 0), const(i64, 1)])
        with par:
            main.b.call(gomp, [body.fn, main.args[0], main.b.trunc(nthreads, i32), const(i32, 0)])
    return main.finish()
