"""The bfloat16 section of bench_kernels.py: Kwker's bf16 kernels against eager bf16 (oneDNN).

Two probes give the roofs: the ``vdpbf16ps`` peak (a JIT'd kernel of 12 independent chains of
``llvm.x86.avx512bf16.dpbf16ps.512`` per thread: 32 multiply-adds, 64 FLOP, per instruction) and
the L3 read bandwidth (a JIT'd kernel summing a 16 MB buffer, half per thread, which stays in the
32 MB L3 between passes). Linear rows give GFLOP/s and % of the bf16 peak; the two memory-bound
ones (m <= 8) also give the weight traffic (n*k*2 bytes per call) in GB/s against the L3 figure.
Each row's result is checked against the float32 computation with the models' contract: Kwker's
max abs error <= 1.25 x eager bf16's + 1e-3 x max|reference|.
"""
from __future__ import annotations

import copy
import ctypes
from pathlib import Path

import common
import probes
import torch
import torch.nn.functional as F
from llvmlite import ir

from kwker.codegen import omp
from kwker.codegen.irutil import f32, i16, i64, intrinsic, ptr
from kwker.codegen.tiles import Tiles
from kwker.kernels.linear import make_linear
from kwker.kernels.sdpa import make_sdpa
from kwker.kernels.specs import instruction_path
from kwker.runtime import tile_permission
from kwker.runtime.compiler import compile_object
from kwker.runtime.loader import load_symbols
from kwker.runtime.target import host_target

BF16 = torch.bfloat16
# (m, n, k): x (m, k) @ W.T, W (n, k), + bias
LINEARS = [(1024, 1024, 1024), (1024, 3072, 768), (128, 768, 768), (8, 4096, 1024),
           (1, 4096, 1024)]
# ratio target, and the fraction of the bf16 peak the two large GEMMs must reach
TARGETS = {(1024, 1024, 1024): (1.0, 0.9), (1024, 3072, 768): (1.0, 0.9),
           (128, 768, 768): (1.05, None), (8, 4096, 1024): (1.5, None),
           (1, 4096, 1024): (1.5, None), (8, 8, 128, 32): (1.5, None),
           (1, 16, 1024, 64): (1.3, None)}
# on CPUs with AMX tiles, against eager bf16 on oneDNN's tile kernels (issue 18); the peak
# fraction is of the tdpbf16ps probe
TARGETS_AMX = {(1024, 1024, 1024): (1.5, 0.4), (1024, 3072, 768): (1.5, 0.4),
               (128, 768, 768): (1.3, None), (8, 4096, 1024): (1.5, None),
               (1, 4096, 1024): (1.5, None), (8, 8, 128, 32): (1.5, None),
               (1, 16, 1024, 64): (1.5, None)}
MEMORY_BOUND = {(8, 4096, 1024), (1, 4096, 1024)}
L3_BYTES = 16 << 20


# ---------------------------------------------------------------------------------- probes
def _dp_probe(iters: int):
    """A JIT'd kernel: ``CHAINS`` independent ``vdpbf16ps`` chains of ``iters`` steps per thread."""
    vf, vh = ir.VectorType(f32, 16), ir.VectorType(i16, 32)
    x = ir.Constant(vh, [ir.Constant(i16, 0x3F80)] * 32)    # bf16 1.0
    y = ir.Constant(vh, [ir.Constant(i16, 0x3A83)] * 32)    # bf16 ~1e-3

    def step(b, acc):
        dp = intrinsic(b.module, "llvm.x86.avx512bf16.dpbf16ps.512", vf, [vf, vh, vh])
        return b.call(dp, [acc, x, y])
    return probes.chain_probe("bf16", vf, step, iters), probes.CHAINS * 64 * iters


def bf16_peak(threads: int, iters: int = 1 << 19, samples: int = 40) -> tuple[float | None, str]:
    """(GFLOP/s of the vdpbf16ps chains on ``threads`` threads, "") or (None, why skipped).

    Best of many short samples (~2 ms each): on a shared machine one of them falls in a quiet
    moment, when both threads run undisturbed."""
    target = host_target()
    if not target.has("avx512bf16"):
        return None, f"skipped: the target CPU ({target.describe()}) has no AVX512_BF16"
    fn, flops = _dp_probe(iters)
    sink = torch.zeros(64)
    return flops * threads / probes.best(lambda: fn(sink.data_ptr(), threads), samples) / 1e9, ""


def _tile_probe(iters: int):
    """A JIT'd kernel: per thread, four independent 16 x 16 float32 accumulator tiles updated
    by ``tdpbf16ps`` from one A and one B tile, ``iters`` steps (16 x 16 x 32 x 2 FLOP each)."""
    target = host_target()
    module = ir.Module("tile_probe")
    body = omp.body_fn(module, "tile_probe.body")
    b = body.b
    sink = omp.Context(body, body.args[0]).ptr(0)
    tiles = Tiles(body, target.tiles, target.has("avx512bf16"))
    a, bt = tiles.new("a"), tiles.new("b")
    accs = [tiles.new(f"c{i}") for i in range(4)]
    stride = ir.Constant(i64, 64)
    tiles.load(a, sink, stride)
    tiles.load(bt, sink, stride)
    for c in accs:
        tiles.zero(c)
    with body.for_range(0, iters):
        for c in accs:
            tiles.dot_bf16(c, a, bt)
    mine = b.gep(sink, [b.mul(body.args[1], ir.Constant(i64, 1024))], source_etype=ir.IntType(8))
    for c in accs:
        tiles.store(c, mine, stride)
    body.finish()
    symbol = f"kw_tile_probe_{iters}"
    omp.emit_parallel(module, symbol, [ptr], body.fn)
    addr = load_symbols(compile_object(str(module), target), [symbol])[symbol]
    fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(addr)
    return fn, 4 * 16 * 16 * 32 * 2 * iters


def tile_peak(threads: int, iters: int = 1 << 14, samples: int = 40) -> tuple[float | None, str]:
    """(GFLOP/s of ``tdpbf16ps`` on ``threads`` threads, "") or (None, why skipped); the tile
    unit takes some 0.1-0.2 s of use to reach full speed on the machines measured, so the
    samples follow a warm-up."""
    target = host_target()
    if target.tiles != "amx":
        why = tile_permission.refusal() or f"the target CPU ({target.describe()}) has no AMX"
        return None, f"skipped: {why}"
    fn, flops = _tile_probe(iters)
    sink = torch.zeros(max(threads, 1) * 256 + 256)
    probes.best(lambda: fn(sink.data_ptr(), threads), samples, min_seconds=0.5)
    return flops * threads / probes.best(lambda: fn(sink.data_ptr(), threads), samples) / 1e9, ""


def l3_bandwidth(threads: int, nbytes: int = L3_BYTES, passes: int = 4,
                 samples: int = 40) -> float:
    """GB/s of reading a ``nbytes`` float32 buffer (fits the L3; warmed by a first pass) on
    ``threads`` threads, best of ``samples`` short samples (as ``bf16_peak``)."""
    return probes.read_gbps(threads, nbytes, passes, samples)


# ------------------------------------------------------------------------------------ rows
class _Attention(torch.nn.Module):
    """Causal SDPA as a module, for Inductor to compile."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _vs_autotune(best_pair, reps: int, kwker, module, *inputs) -> dict:
    """The row's extra columns against Inductor with frozen weights and max-autotune
    (``common.MAX_AUTOTUNE_OPTIONS``, the best PyTorch peer of issue 18): its time, timed
    alternately with Kwker's, and Kwker's speed-up over it. Compiling takes minutes."""
    compiled = torch.compile(module, options=common.MAX_AUTOTUNE_OPTIONS)
    with torch.no_grad():
        compiled(*inputs)
        tk, ta = best_pair(kwker, lambda: compiled(*inputs), reps)
    return {"autotune_ms": ta * 1e3, "autotune_ratio": ta / tk}


def _check(kw, eager, ref) -> str:
    """The accuracy contract against the float32 result ``ref``."""
    ref = ref.double()
    ek = (kw.double() - ref).abs().max().item()
    ee = (eager.double() - ref).abs().max().item()
    bound = 1.25 * ee + 1e-3 * ref.abs().max().item()
    return ("ok" if ek <= bound else "BROKEN") + f" ({ek:.1e} vs eager {ee:.1e})"


def _row(name, tk, te, check, target=None, peak_target=None, **extra) -> dict:
    return {"kernel": name, "kwker_ms": tk * 1e3, "torch_ms": te * 1e3, "ratio": te / tk,
            "target": target, "peak_target": peak_target, "check": check, **extra}


def _targets() -> dict:
    return TARGETS_AMX if host_target().tiles == "amx" else TARGETS


def linear_rows(best_pair, reps: int, peaks: dict, l3: float | None,
                autotune: bool = False) -> list[dict]:
    """``peaks``: instruction path (``instruction_path``) -> its probe's GFLOP/s;
    ``autotune``: also against Inductor max-autotune (``_vs_autotune``)."""
    rows = []
    for m, n, k in LINEARS:
        torch.manual_seed(0)
        w, bias, x = torch.randn(n, k) / k**0.5, torch.randn(n), torch.randn(m, k)
        wb, bb, xb = w.to(BF16), bias.to(BF16), x.to(BF16)
        f = make_linear(wb, bb, m, dtype=BF16)
        check = _check(f(xb), F.linear(xb, wb, bb), F.linear(xb.float(), wb.float(), bb.float()))
        pair_reps = max(3, reps // (4 if m * n * k > 1 << 28 else 1))
        tk, te = best_pair(lambda: f(xb), lambda: F.linear(xb, wb, bb), pair_reps)
        gf = 2 * m * n * k / tk / 1e9
        target, peak_target = _targets()[(m, n, k)]
        path = instruction_path(f.spec, host_target())
        peak = peaks.get(path)
        extra = {"gflops": gf, "peak_frac": gf / peak if peak else None, "path": path}
        if (m, n, k) in MEMORY_BOUND:
            extra["weight_gbps"] = n * k * 2 / tk / 1e9
            extra["l3_frac"] = extra["weight_gbps"] / l3 if l3 else None
        if autotune:
            module = torch.nn.Linear(k, n).to(BF16).eval()
            module.weight.data, module.bias.data = wb, bb
            extra |= _vs_autotune(best_pair, pair_reps, lambda: f(xb), module, xb)
        rows.append(_row(f"bf16 linear {m}x{n}x{k}", tk, te, check, target, peak_target,
                         **extra))
    return rows


def sdpa_rows(best_pair, reps: int, autotune: bool = False) -> list[dict]:
    rows = []
    for shape in [(8, 8, 128, 32), (1, 16, 1024, 64)]:
        b, h, seq, e = shape
        torch.manual_seed(0)
        q, k, v = (torch.randn(*shape).to(BF16) for _ in range(3))
        f = make_sdpa(b, h, seq, seq, e, e, True, dtype=BF16)

        def eager():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        check = _check(f(q, k, v), eager(), ref)
        pair_reps = max(3, reps // (10 if seq > 512 else 1))
        tk, te = best_pair(lambda: f(q, k, v), eager, pair_reps)
        extra = _vs_autotune(best_pair, pair_reps, lambda: f(q, k, v), _Attention(), q, k, v) \
            if autotune else {}
        rows.append(_row(f"bf16 SDPA {shape} causal", tk, te, check, _targets()[shape][0],
                         path=instruction_path(f.spec, host_target()), **extra))
    return rows


def mlp_rows(best_pair, reps: int, autotune: bool = False) -> list[dict]:
    """Linear(1024, 4096) + GELU fused, then Linear(4096, 1024), chained as Kwker runs them."""
    rows = []
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                              torch.nn.Linear(4096, 1024)).eval()
    mlp_b = copy.deepcopy(mlp).to(BF16)
    for batch in (64, 1):
        x = torch.randn(batch, 1024).to(BF16)
        l1 = make_linear(mlp_b[0].weight, mlp_b[0].bias, batch, "gelu", dtype=BF16)
        l2 = make_linear(mlp_b[2].weight, mlp_b[2].bias, batch, dtype=BF16)
        with torch.no_grad():
            check = _check(l2(l1(x)), mlp_b(x), mlp(x.float()))
            tk, te = best_pair(lambda: l2(l1(x)), lambda: mlp_b(x), reps)
        extra = _vs_autotune(best_pair, reps, lambda: l2(l1(x)), copy.deepcopy(mlp_b), x) \
            if autotune else {}
        rows.append(_row(f"bf16 MLP 1024-4096-1024 b{batch}", tk, te, check,
                         note="linear+GELU fused, linear", **extra))
    return rows


def run(best_pair, reps: int, threads: int, autotune: bool = False) -> dict:
    """The whole section: probes, then every row (``best_pair`` from bench_kernels);
    ``autotune``: each row also against Inductor max-autotune."""
    peak, why = bf16_peak(threads)
    tile, tile_why = tile_peak(threads)
    l3 = l3_bandwidth(threads)
    rows = linear_rows(best_pair, reps, {"avx512-bf16": peak, "amx": tile}, l3, autotune) \
        + sdpa_rows(best_pair, reps, autotune) + mlp_rows(best_pair, reps, autotune)
    if peak:
        # probed once more after the rows, the best kept (as the FMA probe is): on the Zen 5 VM
        # the probe at the start read 479-489 GFLOP/s in two runs, and 920 alone a minute later
        again, _ = bf16_peak(threads)
        if again > peak:
            for r in rows:
                if r.get("path") == "avx512-bf16" and r.get("gflops"):
                    r["peak_frac"] = r["gflops"] / again
            peak = again
    for r in rows:
        r["met"] = None if r["target"] is None else bool(
            r["ratio"] >= r["target"] and (r["peak_target"] is None
                                            or (r.get("peak_frac") or 0) >= r["peak_target"]))
    return {"peak_gflops": peak, "peak_skipped": why, "tile_peak_gflops": tile,
            "tile_peak_skipped": tile_why, "l3_gbps": l3, "l3_bytes": L3_BYTES, "rows": rows}


# ---------------------------------------------------------------------------------- output
def _pct(x) -> str:
    return "—" if x is None else f"{x:.0%}"


def _autotune_cells(r: dict) -> str:
    if "autotune_ms" not in r:
        return " | |"
    verdict = "ahead" if r["autotune_ratio"] > 1 else "BEHIND"
    return f" {r['autotune_ms']:.3f} | {r['autotune_ratio']:.2f}x {verdict} |"


def render(sec: dict) -> str:
    peak = sec["peak_gflops"]
    head = (f"vdpbf16ps peak probe ({probes.CHAINS} chains per thread): "
            + (f"{peak:.0f} GFLOP/s" if peak else sec["peak_skipped"])
            + "; tdpbf16ps (AMX) peak probe (4 accumulator tiles per thread): "
            + (f"{sec['tile_peak_gflops']:.0f} GFLOP/s" if sec.get("tile_peak_gflops")
               else sec.get("tile_peak_skipped", "not measured"))
            + f"; L3 read bandwidth probe ({sec['l3_bytes'] >> 20} MB buffer): "
              f"{sec['l3_gbps']:.0f} GB/s")
    tuned = any("autotune_ms" in r for r in sec["rows"])   # bench_kernels.py --max-autotune
    out = ["## bfloat16 (vs eager bf16: oneDNN)", "", head, "",
           "Plot: [kernels_bf16.png](kernels_bf16.png)", "",
           "| kernel | path | eager ms | kwker ms | speed-up | target | GFLOP/s | % of its "
           "path's peak | weight GB/s (% of L3) | check | note |"
           + (" Inductor max-autotune ms | max-autotune / Kwker |" if tuned else ""),
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|" + ("---:|---:|" if tuned
                                                                     else "")]
    for r in sec["rows"]:
        mark = ""
        if r["target"] is not None:
            mark = f"{r['target']:.2g}x" + (f", {r['peak_target']:.0%} of peak"
                                            if r["peak_target"] else "")
            mark += " ok" if r["met"] else " BELOW"
        gb = (f"{r['weight_gbps']:.0f} ({_pct(r.get('l3_frac'))})" if "weight_gbps" in r
              else "")
        gf = f"{r['gflops']:.0f}" if "gflops" in r else ""
        pk = _pct(r.get("peak_frac")) if "gflops" in r else ""
        out.append(f"| {r['kernel']} | {r.get('path', '')} | {r['torch_ms']:.3f} | "
                   f"{r['kwker_ms']:.3f} | {r['ratio']:.2f}x | {mark} | {gf} | {pk} | {gb} | "
                   f"{r['check']} | {r.get('note', '')} |" + (_autotune_cells(r) if tuned else ""))
    return "\n".join(out)


def headline(sec: dict) -> list[dict]:
    """The index's bf16 kernel figures: the two GEMM kinds, SDPA, and the furthest row."""
    rows = sec.get("rows", [])
    pick = ("bf16 linear 1024x1024x1024", "bf16 linear 1x4096x1024",
            "bf16 SDPA (8, 8, 128, 32) causal")
    out = [{"label": r["kernel"], "ratio": r["ratio"], "target": r["target"]}
           for p in pick for r in rows if r["kernel"] == p]
    targeted = [r for r in rows if r["target"]]
    if targeted:
        low = min(targeted, key=lambda r: r["ratio"] / r["target"])
        out.append({"label": f"bf16 furthest from its target: {low['kernel']}",
                    "ratio": low["ratio"], "target": low["target"]})
    return out


def plot(sec: dict, path: Path, title: str) -> bool:
    """Eager bf16 time / Kwker time per row (log), target ticks, % of peak or GB/s noted."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = sec["rows"]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.32 * len(rows)))
    colors = ["tab:red" if r["met"] is False else "tab:green" if r["ratio"] >= 1
              else "tab:orange" for r in rows]
    notes = [f"{_pct(r.get('peak_frac'))} of peak" if r.get("peak_frac") and
             "weight_gbps" not in r else f"{r['weight_gbps']:.0f} GB/s" if "weight_gbps" in r
             else "" for r in rows]
    common.ratio_bars(ax, [r["kernel"] for r in rows], [r["ratio"] for r in rows],
                      [r["target"] for r in rows], colors, notes)
    ax.set_xlabel("eager bf16 ms / Kwker ms (log; black tick = target, red = below it)",
                  fontsize=8)
    return common.save_plot(fig, path, title)
