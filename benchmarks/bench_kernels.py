"""Kwker compute kernels vs PyTorch on this machine: GEMM, MLP, SDPA, fused scoring + top-k.

    python benchmarks/bench_kernels.py [--threads 2] [--reps 30] [--quick]

Every row is best-of-N after a warm-up, the Kwker kernel and its torch counterpart timed
alternately in one process (the ratio is the number to read on a shared, noisy machine). GEMM
rows also give GFLOP/s and the fraction of the FMA peak measured by a JIT'd probe (12 independent
chains of vector ``llvm.fma`` per thread). Prints a table and writes
benchmarks/results/kernels.{md,json,png}; ``--quick`` writes files only with ``--out DIR``.

The bf16 section (kernels_bf16.py; ``--section bf16`` alone) times the bf16 kernels against eager
bf16 (oneDNN), with a ``vdpbf16ps`` peak probe and an L3 bandwidth probe as roofs, and writes
kernels_bf16.png beside the table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from llvmlite import ir

from kwker.codegen import simd, vmath
from kwker.codegen.irutil import f32
from kwker.kernels.eltwise import make_gelu
from kwker.kernels.linear import make_linear
from kwker.kernels.matmul import make_matmul
from kwker.kernels.sdpa import make_sdpa
from kwker.kernels.topk import make_linear_topk
from kwker.runtime.target import host_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import kernels_bf16
import probes

GEMM_SHAPES = [(512, 512, 512), (1024, 1024, 1024), (32, 20000, 128), (8, 4096, 1024),
               (1, 4096, 1024), (64, 4096, 1024)]
TARGETS = {(512, 512, 512): 1.0, (1024, 1024, 1024): 1.0, (32, 20000, 128): 1.3,
           (8, 4096, 1024): 1.3, (1, 4096, 1024): 1.5, "mlp64": 1.2, "mlp1": 1.5,
           "sdpa": 1.3, "ranker32": 3.0}


def best_pair(fa, fb, reps: int, min_seconds: float = 0.5) -> tuple[float, float]:
    """Best times (s) of two callables, measured alternately so load hits both alike; at least
    ``reps`` rounds and ``min_seconds`` (a quiet moment is likelier in a longer window)."""
    fa(), fb()
    ta = tb = float("inf")
    start, rounds = time.perf_counter(), 0
    while rounds < reps or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fa()
        ta = min(ta, time.perf_counter() - t)
        t = time.perf_counter()
        fb()
        tb = min(tb, time.perf_counter() - t)
        rounds += 1
        if rounds >= 50 * reps:
            break
    return ta, tb


def _probe(iters: int):
    """A JIT'd kernel: 12 independent FMA chains of ``iters`` steps on every thread."""
    lanes = simd.float_lanes(host_target())
    vt = ir.VectorType(f32, lanes)
    x, y = vmath.splat(vt, 0.999), vmath.splat(vt, 1e-3)
    fn = probes.chain_probe("fma", vt, lambda b, a: vmath.fma(b, a, x, y), iters)
    return fn, probes.CHAINS * lanes * 2 * iters


def fma_peak(threads: int, iters: int = 1 << 22) -> float:
    """GFLOP/s of 12 independent FMA chains per thread on the widest vectors of this CPU."""
    fn, flops = _probe(iters)
    sink = torch.zeros(64)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        fn(sink.data_ptr(), threads)
        best = min(best, time.perf_counter() - t)
    return flops * threads / best / 1e9


def fork_join_us(threads: int, reps: int = 2000) -> float:
    """Microseconds of one ctypes call of a parallel kernel with (almost) no work."""
    fn, _ = _probe(1)
    sink = torch.zeros(64)
    ptr_ = sink.data_ptr()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn(ptr_, threads)
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def dispatch_overhead(reps: int) -> tuple[float, float]:
    """(us per call of a tiny 2-thread kwker kernel, us of the same ATen op)."""
    x = torch.randn(1 << 16)
    g = make_gelu(x.numel())
    tk, tt = best_pair(lambda: g(x), lambda: F.gelu(x), reps * 10)
    return tk * 1e6, tt * 1e6


def gemm_rows(reps, peaks: list, threads: int):
    """The GEMM rows; ``peaks`` (the FMA probes so far) gains a probe after each GEMM, and the
    fractions are of the highest: on a VM the probe alone can land in a slow minute."""
    rows, timed = [], []
    for m, n, k in GEMM_SHAPES:
        torch.manual_seed(0)
        w, x = torch.randn(n, k), torch.randn(m, k)
        f = make_linear(w, None, m)
        wt = w.t()
        tk, tt = best_pair(lambda: f(x), lambda: torch.mm(x, wt), reps)
        peaks.append(fma_peak(threads))
        timed.append((m, n, k, tk, tt))
    peak = max(peaks)
    for m, n, k, tk, tt in timed:
        gf = 2 * m * n * k / tk / 1e9
        rows.append((f"GEMM {m}x{n}x{k}", tk, tt, f"{gf:.0f} GF/s, {gf / peak:.0%} of peak",
                     TARGETS.get((m, n, k))))
    torch.manual_seed(0)
    a, b = torch.randn(8, 256, 64), torch.randn(8, 64, 256)
    f = make_matmul(256, 64, 256, batch=8)
    tk, tt = best_pair(lambda: f(a, b), lambda: torch.bmm(a, b), reps)
    rows.append(("bmm 8x(256x64 @ 64x256)", tk, tt, "", None))
    return rows


def mlp_rows(reps):
    rows = []
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                              torch.nn.Linear(4096, 1024)).eval()
    for batch in (64, 1):
        x = torch.randn(batch, 1024)
        l1 = make_linear(mlp[0].weight, mlp[0].bias, batch, "gelu")
        l2 = make_linear(mlp[2].weight, mlp[2].bias, batch)
        with torch.no_grad():
            tk, tt = best_pair(lambda: l2(l1(x)), lambda: mlp(x), reps)
        rows.append((f"MLP 1024-4096-1024 b{batch}", tk, tt, "linear+GELU fused, linear",
                     TARGETS[f"mlp{batch}"]))
    return rows


def sdpa_rows(reps):
    rows = []
    for shape in [(8, 8, 128, 32), (1, 16, 1024, 64)]:
        b, h, seq, e = shape
        torch.manual_seed(0)
        q, k, v = (torch.randn(*shape) for _ in range(3))
        for causal in (False, True):
            f = make_sdpa(b, h, seq, seq, e, e, causal)
            tk, tt = best_pair(lambda: f(q, k, v),
                               lambda: F.scaled_dot_product_attention(q, k, v,
                                                                      is_causal=causal),
                               max(3, reps // (10 if seq > 512 else 1)))
            # the target: (8, 8, 128, 32) and (1, 16, 1024, 64) causal
            target = TARGETS["sdpa"] if causal or seq < 512 else None
            rows.append((f"SDPA {shape}{' causal' if causal else ''}", tk, tt,
                         "vs ATen flash", target))
    return rows


def ranker_rows(reps):
    """The tutorial's Ranker: Linear(64,256)-GELU-Linear(256,128), scores vs 20000 items, top 10."""
    rows = []
    torch.manual_seed(0)
    query = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 128)).eval()
    items = torch.randn(20000, 128) / 128 ** 0.5
    for batch in (32, 1):
        x = torch.randn(batch, 64)
        l1 = make_linear(query[0].weight, query[0].bias, batch, "gelu")
        l2 = make_linear(query[2].weight, query[2].bias, batch)
        top = make_linear_topk(items, batch, 10)

        def eager():
            with torch.no_grad():
                return torch.topk(query(x) @ items.t(), 10, dim=-1)
        tk, tt = best_pair(lambda: top(l2(l1(x))), eager, reps)
        rows.append((f"Ranker b{batch} (MLP + scores + topk 10)", tk, tt, "fused scoring+top-k",
                     TARGETS.get(f"ranker{batch}")))
    return rows


def gelu_rows(reps):
    x = torch.randn(64 * 4096)
    g = make_gelu(x.numel())
    gt = make_gelu(x.numel(), "tanh")
    tk, tt = best_pair(lambda: g(x), lambda: F.gelu(x), reps)
    tk2, tt2 = best_pair(lambda: gt(x), lambda: F.gelu(x, approximate="tanh"), reps)
    return [("GELU erf 64x4096", tk, tt, "", None), ("GELU tanh 64x4096", tk2, tt2, "", None)]


def as_dicts(rows) -> list[dict]:
    """The (name, kwker s, torch s, note, target) tuples as the JSON's rows."""
    return [{"kernel": name, "kwker_ms": tk * 1e3, "torch_ms": tt * 1e3, "ratio": tt / tk,
             "target": target, "met": None if target is None else tt / tk >= target,
             "note": note} for name, tk, tt, note, target in rows]


def render(rows: list[dict], header: str) -> str:
    out = [header, "", "| kernel | kwker ms | torch ms | speed-up | target | note |",
           "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        mark = "" if r["target"] is None else f"{r['target']:.1f}x " + (
            "ok" if r["met"] else "BELOW")
        out.append(f"| {r['kernel']} | {r['kwker_ms']:.3f} | {r['torch_ms']:.3f} | "
                   f"{r['ratio']:.2f}x | {mark} | {r['note']} |")
    return "\n".join(out)


def headline(rows: list[dict]) -> list[dict]:
    """The index's figures: the issue's main kernel targets and the case furthest below its own."""
    pick = ("Ranker b32", "GEMM 32x20000x128", "MLP 1024-4096-1024 b64",
            "SDPA (8, 8, 128, 32) causal")
    out = [{"label": r["kernel"], "ratio": r["ratio"], "target": r["target"]}
           for p in pick for r in rows if r["kernel"].startswith(p)]
    targeted = [r for r in rows if r["target"]]
    if targeted:
        low = min(targeted, key=lambda r: r["ratio"] / r["target"])
        out.append({"label": f"furthest from its target: {low['kernel']}", "ratio": low["ratio"],
                    "target": low["target"]})
    return out


def plot(rows: list[dict], path: Path, title: str) -> bool:
    """torch time / Kwker time per case (log), black ticks at the targets, % of peak for GEMMs."""
    plt = common.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.32 * len(rows)))
    colors = ["tab:red" if r["met"] is False else "tab:green" if r["ratio"] >= 1 else "tab:orange"
              for r in rows]
    notes = [r["note"].split(", ")[-1] if "of peak" in r["note"] else "" for r in rows]
    common.ratio_bars(ax, [r["kernel"] for r in rows], [r["ratio"] for r in rows],
                      [r["target"] for r in rows], colors, notes)
    ax.set_xlabel("torch ms / Kwker ms (log; black tick = target, red = below it)", fontsize=8)
    return common.save_plot(fig, path, title)


def _old_header(data: dict) -> str:
    """The float32 table's header from a results file written before headers were stored."""
    m = data.get("machine", {})
    d_k, d_t = data.get("gelu_call_us") or (float("nan"),) * 2
    return (f"# Kwker kernels vs torch {m.get('torch', '?')}\n\n{m.get('cpu', '?')}, "
            f"{m.get('threads', '?')} threads, best of {data.get('reps', '?')}; FMA peak probe "
            f"{data.get('fma_peak_gflops', float('nan')):.0f} GFLOP/s; parallel kernel call with "
            f"no work (ctypes + fork/join) {data.get('fork_join_us', float('nan')):.1f} us; "
            f"GELU 65536 call {d_k:.1f} us (ATen {d_t:.1f} us)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, no results files")
    ap.add_argument("--section", choices=("all", "f32", "bf16"), default="all",
                    help="float32 kernels, bf16 kernels or both (a subset updates only its "
                         "part of the results files)")
    ap.add_argument("--max-autotune", action="store_true",
                    help="bf16 section: also Inductor with frozen weights and max-autotune, the "
                         "best PyTorch peer (minutes of compiling)")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    reps = 8 if args.quick else args.reps
    torch.set_num_threads(args.threads)
    info = common.machine_info()
    out = args.out or (None if args.quick else common.RESULTS)
    data = {}
    if out is not None and args.section != "all":  # keep the section not run this time
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((out / "kernels.json").read_text())
    data.update({"benchmark": "kernels", "script": "bench_kernels.py"})
    data.setdefault("machine", info)
    if args.section in ("all", "f32"):
        peaks = [fma_peak(args.threads)]
        d_k, d_t = dispatch_overhead(reps)
        fork = fork_join_us(args.threads)
        rows = as_dicts(gemm_rows(reps, peaks, args.threads) + mlp_rows(reps) + sdpa_rows(reps)
                        + ranker_rows(reps) + gelu_rows(reps))
        peak = max(peaks)
        header = (f"# Kwker kernels vs torch {torch.__version__}\n\n"
                  f"{host_target().describe()}, {args.threads} threads, best of {reps}, "
                  f"{platform.node()}; FMA peak probe {peak:.0f} GFLOP/s (best of {len(peaks)} "
                  f"probes through the run, lowest {min(peaks):.0f}); "
                  f"parallel kernel call with no work (ctypes + fork/join) {fork:.1f} us; "
                  f"GELU 65536 call {d_k:.1f} us (ATen {d_t:.1f} us)")
        data.update({"machine": info, "reps": reps, "fma_peak_gflops": peak,
                     "fork_join_us": fork, "gelu_call_us": [d_k, d_t], "header": header,
                     "rows": rows})
        print(render(rows, header))
    if args.section in ("all", "bf16"):
        sec = kernels_bf16.run(best_pair, reps, args.threads, args.max_autotune)
        data["bf16"] = {"machine": info, "reps": reps, **sec}
        print()
        print(kernels_bf16.render(data["bf16"]))
    rows, sec = data.get("rows", []), data.get("bf16")
    broken = [r["kernel"] for r in (sec or {}).get("rows", []) if r["check"].startswith("BROKEN")]
    for name in broken:
        print(f"ACCURACY CONTRACT BROKEN (bug): {name}", file=sys.stderr)
    if out is None:
        return 1 if broken else 0
    out.mkdir(parents=True, exist_ok=True)
    text = render(rows, data.get("header") or _old_header(data)) + \
        "\n\nPlot: [kernels.png](kernels.png)\n"
    if sec:
        text += "\n" + kernels_bf16.render(sec) + "\n"
    (out / "kernels.md").write_text(text)
    data["headline"] = headline(rows) + (kernels_bf16.headline(sec) if sec else [])
    common.write_json(out / "kernels.json", data)
    title = common.machine_line(data.get("machine", info))
    if rows:
        plot(rows, out / "kernels.png", f"Kwker kernels vs torch; {title}")
    if sec:
        title = f"Kwker bf16 kernels vs eager bf16; {common.machine_line(sec['machine'])}"
        kernels_bf16.plot(sec, out / "kernels_bf16.png", title)
    print(f"wrote {out / 'kernels.md'}, kernels.json, kernels.png, kernels_bf16.png")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
