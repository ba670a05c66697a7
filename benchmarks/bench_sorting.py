"""Kwker's eager sorting-type ops against ATen's, through the public path.

Each case times the same ``torch.*`` call plainly (ATen) and inside ``kto.accelerated()``
(Kwker), interleaved in one process, best of N after warm-up, on 2 threads. Before timing, the
Kwker result is checked to be identical to ATen's (values and indices): a speed-up of a wrong
answer is a bug, and the table says so loudly.

    python benchmarks/bench_sorting.py            # full run, writes results/sorting.{md,json,png}
    python benchmarks/bench_sorting.py --quick    # smoke run (< ~1 min), prints only
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

FLOOR = 0.9  # no op may be slower than 0.9x ATen at any size
MAIN = (32, 20000)
SWEEP_SHAPES = [(8,), (64,), (1, 512), (1024, 16), (16, 1000), (8, 4096), MAIN]  # (1024, 16): many short rows
SWEEP_OPS = ["topk", "sort", "stable sort", "argsort", "msort", "kthvalue", "median(dim)",
             "nanmedian(dim)", "mode", "quantile", "nanquantile", "median()"]
TARGETS = {"topk": 4.0, "sort": 6.0, "stable sort": 6.0, "kthvalue": 5.0, "median(dim)": 5.0,
           "quantile": 10.0}
NAN_OPS = {"nanmedian(dim)", "nanquantile"}  # benchmarked on inputs with 1% NaN


@dataclass
class Case:
    section: str
    op: str
    shape: tuple
    dtype: torch.dtype
    params: str
    fn: Callable[[torch.Tensor], tuple]  # the public torch call, normalised to a tuple
    kind: str = "randn"                   # input distribution: randn, nan, ties, ints
    target: float | None = None           # required ATen/Kwker ratio; FLOOR when None

    @property
    def label(self) -> str:
        return f"{self.op} {fmt_shape(self.shape)} {str(self.dtype)[6:]} {self.params}".strip()


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


# ------------------------------------------------------------------------------------ inputs
def make_input(shape, dtype, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(0, 4, shape, generator=g).to(dtype)
    if not dtype.is_floating_point:
        return torch.randint(0, 100_000, shape, generator=g, dtype=dtype)
    x = torch.randn(shape, generator=g, dtype=dtype)
    if kind == "nan":
        x[torch.rand(shape, generator=g) < 0.01] = float("nan")
    return x


def op_call(op: str, shape, dtype, k: int | None = None) -> tuple[str, Callable]:
    """(params text, call) for ``op`` along the last dim of a tensor of ``shape``."""
    n = shape[-1]
    if op == "topk":
        k = k or min(10, max(1, n // 2))
        return f"k={k}", lambda x: tuple(torch.topk(x, k, dim=-1))
    if op == "sort":
        return "", lambda x: tuple(torch.sort(x, dim=-1))
    if op == "stable sort":
        return "stable=True", lambda x: tuple(torch.sort(x, dim=-1, stable=True))
    if op == "argsort":
        return "", lambda x: (torch.argsort(x, dim=-1),)
    if op == "msort":
        if len(shape) == 1:
            return "", lambda x: (torch.msort(x),)
        return f"of x.t(), {fmt_shape(shape[::-1])} view", lambda x: (torch.msort(x.t()),)
    if op == "kthvalue":
        kk = max(1, n // 2)
        return f"k={kk}", lambda x: tuple(torch.kthvalue(x, kk, dim=-1))
    if op == "median(dim)":
        return "dim=-1", lambda x: tuple(torch.median(x, dim=-1))
    if op == "nanmedian(dim)":
        return "dim=-1, 1% NaN", lambda x: tuple(torch.nanmedian(x, dim=-1))
    if op == "mode":
        return "dim=-1", lambda x: tuple(torch.mode(x, dim=-1))
    if op in ("quantile", "nanquantile"):
        q = torch.tensor([0.1, 0.5, 0.9], dtype=dtype)
        f = torch.quantile if op == "quantile" else torch.nanquantile
        text = "q=[.1,.5,.9], dim=-1" + (", 1% NaN" if op == "nanquantile" else "")
        return text, lambda x: (f(x, q, dim=-1),)
    if op == "median()":
        return "all elements", lambda x: (torch.median(x),)
    raise ValueError(f"unknown op {op!r}")


def case(section, op, shape, dtype=torch.float32, kind=None, target=None, k=None) -> Case:
    params, fn = op_call(op, shape, dtype, k)
    kind = kind or ("nan" if op in NAN_OPS else "randn" if dtype.is_floating_point else "ints")
    if kind == "ties":
        params = (params + ", " if params else "") + "randint(0,4) ties"
    return Case(section, op, tuple(shape), dtype, params, fn, kind, target)


def cases(quick: bool = False) -> list[Case]:
    """Every benchmark case; ``quick`` keeps a representative subset for smoke runs."""
    out = [case("main", op, MAIN, target=TARGETS.get(op)) for op in SWEEP_OPS]
    out += [case("sampling", "topk", (r, 50257), k=50, target=3.0)
            for r in ((32,) if quick else (1, 32))]
    out.append(case("1-D", "sort", (1_000_000,), target=6.0))
    dtype_ops = ["sort"] if quick else ["topk", "sort", "stable sort", "kthvalue",
                                        "median(dim)", "mode"]
    for dtype in (torch.float64, torch.int64):
        out += [case("dtypes", op, MAIN, dtype) for op in dtype_ops]
        if dtype.is_floating_point and not quick:
            out.append(case("dtypes", "quantile", MAIN, dtype))
    for op in (["sort"] if quick else ["sort", "stable sort", "topk"]):
        out.append(case("ties", op, MAIN, kind="ties", target=TARGETS.get(op)))
    shapes = [(8,), (16, 1000)] if quick else SWEEP_SHAPES[:-1]
    out += [case("sweep", op, s) for s in shapes for op in SWEEP_OPS]
    return out


# ------------------------------------------------------------------------------------ checks
def _same(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why ``b`` is not ATen's ``a`` (shape, dtype, strides, NaN positions, values), or None."""
    if a.shape != b.shape:
        return f"shape {tuple(b.shape)} != {tuple(a.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {b.dtype} != {a.dtype}"
    if a.numel() > 1 and a.stride() != b.stride():
        return f"strides {b.stride()} != {a.stride()}"
    if a.is_floating_point():
        na, nb = a.isnan(), b.isnan()
        if not torch.equal(na, nb):
            return "NaN positions differ"
        a, b = a.masked_fill(na, 0), b.masked_fill(nb, 0)
    if not torch.equal(a, b):
        return f"{int((a != b).sum())} of {a.numel()} elements differ"
    return None


def check(c: Case, x: torch.Tensor) -> str:
    """'ok' (Kwker kernel ran, identical), 'ok, ATen path' (Kwker handed off), or MISMATCH."""
    import kwker.torch_ops as kto
    from kwker.ops import rows

    ref = c.fn(x)
    before = sum(rows.calls.values())
    with kto.accelerated():
        got = c.fn(x)
    ran = sum(rows.calls.values()) > before
    names = ("values", "indices") if len(ref) == 2 else ("indices",) if c.op == "argsort" \
        else ("values",)
    for name, a, b in zip(names, ref, got):
        why = _same(a, b)
        if why:
            return f"MISMATCH {name}: {why}"
    return "ok" if ran else "ok, ATen path"


# ------------------------------------------------------------------------------------ timing
BUDGET = 0.05  # seconds per case and round below which cheap calls get extra samples


@dataclass
class Timed:
    """A case being timed: its input, check status, the two sides and their sample size."""

    case: Case
    status: str
    sides: list
    number: int
    bounds: list = field(default_factory=lambda: [0])  # sample index where each round ends

    def sample(self, reps: int, budget: float) -> None:
        common.sample_round(self.sides, reps, self.number, budget)
        self.bounds.append(len(self.sides[0].samples))


def prepare(c: Case, warmup: int, min_sample: float) -> Timed:
    import kwker.torch_ops as kto

    x = make_input(c.shape, c.dtype, c.kind)
    status = check(c, x)
    # primed: entering accelerated() registers Kwker's kernels (~0.4 ms) and leaves the caches
    # cold for the next call (~30 us more on Zen 3); the samples time the calls of an open block
    sides = [common.Side("ATen", lambda: c.fn(x), prime=True),
             common.Side("Kwker", lambda: c.fn(x), kto.accelerated, prime=True)]
    return Timed(c, status, sides, common.calibrate(sides, warmup, min_sample))


def result(t: Timed) -> dict:
    c, (aten, kw) = t.case, t.sides
    ratio = aten.best / kw.best
    target = c.target if c.target is not None else FLOOR
    def round_bests(side):
        return [min(side.samples[a:b]) * 1e3 for a, b in zip(t.bounds, t.bounds[1:])]

    return {
        "section": c.section, "op": c.op, "shape": list(c.shape), "dtype": str(c.dtype)[6:],
        "params": c.params, "aten_ms": aten.best * 1e3, "kwker_ms": kw.best * 1e3,
        "ratio": ratio, "target": target, "explicit_target": c.target is not None,
        "met": ratio >= target and not t.status.startswith("MISMATCH"), "check": t.status,
        "reps": len(aten.samples), "calls_per_sample": t.number,
        "aten_ms_per_round": round_bests(aten), "kwker_ms_per_round": round_bests(kw),
    }


def run(case_list: list[Case], reps: int, warmup: int, min_sample: float, rounds: int = 1,
        log=print, budget: float = 0.0) -> list[dict]:
    """Time every case: ``rounds`` passes over all cases, ``reps`` samples per side each.

    Spreading a case's samples over passes keeps one burst of background load (which on 2 busy
    cores stalls every 2-thread OpenMP region) from spoiling all of them.
    """
    timed = []
    for i, c in enumerate(case_list, 1):
        t = prepare(c, warmup, min_sample)
        t.sample(reps, budget)
        timed.append(t)
        r = result(t)
        flag = "" if r["met"] else "   <-- below target" if r["check"][:2] == "ok" else \
            "   <-- " + r["check"]
        log(f"[{i:3d}/{len(case_list)}] {c.label:60s} {r['ratio']:6.2f}x{flag}", flush=True)
    for k in range(1, rounds):
        for t in timed:
            t.sample(reps, budget)
        log(f"round {k + 1}/{rounds} done", flush=True)
    return [result(t) for t in timed]


def run_case(c: Case, reps: int, warmup: int, min_sample: float) -> dict:
    (row,) = run([c], reps, warmup, min_sample, log=lambda *a, **k: None)
    return row


# ------------------------------------------------------------------------------------ report
HEADERS = ["op", "shape", "dtype", "params", "ATen ms", "Kwker ms", "ratio (ATen/Kwker)",
           "target", "met?", "check", "ratio per pass"]
SECTIONS = {"main": "(32, 20000) float32, along the last dim",
            "sampling": "Top-k sampling (vocabulary 50257, k=50)",
            "1-D": "1-D sort", "dtypes": "Other dtypes at (32, 20000)",
            "ties": "Tie-heavy input (randint(0, 4) as float32) at (32, 20000)",
            "sweep": "Size sweep, float32 (floor: no op below 0.9x ATen)"}


def table_rows(rows: list[dict], markdown: bool) -> list[list]:
    out = []
    for r in rows:
        met = "yes" if r["met"] else "NO"
        check = r["check"]
        if markdown and check.startswith("MISMATCH"):
            check = f"**{check}**"
        if markdown and not r["met"]:
            met = "**NO**"
        target = f">= {r['target']:g}x" if r["explicit_target"] else f">= {FLOOR}x (floor)"
        out.append([r["op"], fmt_shape(r["shape"]), r["dtype"], r["params"],
                    common.fmt_ms(r["aten_ms"] / 1e3), common.fmt_ms(r["kwker_ms"] / 1e3),
                    f"{r['ratio']:.2f}", target, met, check, pass_range(r)])
    return out


def pass_range(r: dict) -> str:
    """min-max of the per-pass ratios: a wide range means the machine was busy, not the code."""
    per = [a / k for a, k in zip(r.get("aten_ms_per_round", []), r.get("kwker_ms_per_round", []))]
    if len(per) < 2:
        return ""
    return f"{min(per):.2f}-{max(per):.2f}"


def sweep_table(rows: list[dict], markdown: bool = True) -> str:
    """op x shape matrix of ratios (the floor check), ratios below FLOOR marked."""
    cell = {(r["op"], tuple(r["shape"])): r for r in rows
            if r["dtype"] == "float32" and r["section"] in ("sweep", "main")}
    shapes = [s for s in SWEEP_SHAPES if any((op, s) in cell for op in SWEEP_OPS)]
    body = []
    for op in SWEEP_OPS:
        line = [op]
        for s in shapes:
            r = cell.get((op, s))
            if r is None:
                line.append("")
                continue
            txt = f"{r['ratio']:.2f}"
            if r["ratio"] < FLOOR:
                txt = f"**{txt} < 0.9**" if markdown else f"{txt} <0.9"
            if r["check"].startswith("MISMATCH"):
                txt += " MISMATCH"
            elif r["check"] != "ok":
                txt += " (ATen path)" if markdown else "*"
            line.append(txt)
        body.append(line)
    headers = ["op"] + [fmt_shape(s) for s in shapes]
    return (common.md_table if markdown else common.text_table)(headers, body)


def headline(rows: list[dict]) -> list[dict]:
    """The few figures the results index shows."""
    pick = [("main", "topk"), ("main", "sort"), ("main", "median(dim)"), ("main", "quantile"),
            ("sampling", "topk"), ("1-D", "sort")]
    out = []
    for section, op in pick:
        found = [r for r in rows if r["section"] == section and r["op"] == op]
        if found:
            r = found[-1]
            out.append({"label": f"{op} {fmt_shape(r['shape'])}", "ratio": r["ratio"],
                        "target": r["target"]})
    if rows:
        low = min(rows, key=lambda r: r["ratio"])
        out.append({"label": f"lowest: {low['op']} {fmt_shape(low['shape'])} {low['dtype']}",
                    "ratio": low["ratio"], "target": FLOOR})
    return out


def summary(rows: list[dict]) -> list[str]:
    bad = [r for r in rows if r["check"].startswith("MISMATCH")]
    slow = [r for r in rows if r["ratio"] < FLOOR]
    missed = [r for r in rows if r["explicit_target"] and r["ratio"] < r["target"]]
    lines = []
    for r in bad:
        lines.append(f"RESULT MISMATCH (bug): {r['op']} {fmt_shape(r['shape'])} {r['dtype']} "
                     f"{r['params']}: {r['check']}")
    lines.append(f"{len(rows) - len(bad)}/{len(rows)} cases identical to ATen; "
                 f"{sum(r['check'] == 'ok, ATen path' for r in rows)} of them handed to ATen.")
    lines.append(f"explicit targets met: {sum(r['explicit_target'] for r in rows) - len(missed)}"
                 f"/{sum(r['explicit_target'] for r in rows)}"
                 + ("" if not missed else "; missed: " + ", ".join(
                     f"{r['op']} {fmt_shape(r['shape'])} {r['dtype']} ({r['ratio']:.2f}x < "
                     f"{r['target']:g}x)" for r in missed)))
    lines.append(f"below the {FLOOR}x floor: " + (", ".join(
        f"{r['op']} {fmt_shape(r['shape'])} {r['dtype']} ({r['ratio']:.2f}x)" for r in slow)
        or "none"))
    return lines


def markdown(rows: list[dict], info: dict, reps: int, warmup: int, min_sample: float,
             rounds: int = 1, budget: float = 0.0) -> str:
    spread = f" ({rounds} passes over all cases, >= {reps} each)" if rounds > 1 else ""
    extra = (f" Cheap calls get more samples (up to 4x, until {budget * 1e3:g} ms per case "
             "and pass are spent); the JSON has each case's count.") if budget else ""
    method = (
        f"Times are the **best of >= {reps * rounds}** samples per side{spread} after "
        f"{warmup} warm-up calls, ATen and Kwker samples interleaved (alternating order) in "
        f"one process, {info['threads']} threads; a sample repeats calls back to back until "
        f"it lasts >= {min_sample * 1e3:g} ms and reports ms per call.{extra} ATen = the plain "
        "`torch.*` call; Kwker = the same call inside `kto.accelerated()`, entered per sample "
        "(each sample starts with one untimed call on both sides: entering the block registers "
        "Kwker's kernels, ~0.4 ms, and leaves the caches cold for one call). ratio = ATen ms / "
        "Kwker ms (higher is better). Every Kwker result was first checked identical to "
        "ATen's (values and indices, NaN positions, strides); `ok, ATen path` = Kwker handed "
        "the case to ATen. The machine is shared with other jobs: treat absolute times as "
        "noisy and compare ratios; `ratio per pass` is the range of the ratios of each pass's "
        "best samples (a wide range means background load, not the code).")
    parts = ["# Sorting-type ops: Kwker vs ATen (eager, CPU)", "",
             f"Machine: {common.machine_line(info)}, {info.get('load_end', '?')} at the end.",
             "", method, "", "## Summary", ""]
    parts += [f"- {line}" for line in summary(rows)]
    for section in dict.fromkeys([*SECTIONS, *(r["section"] for r in rows)]):
        sec = [r for r in rows if r["section"] == section]
        if sec:
            parts += ["", f"## {SECTIONS.get(section, section)}", "",
                      common.md_table(HEADERS, table_rows(sec, True))]
    if any(r["section"] == "sweep" for r in rows):
        parts += ["", "## Floor check: ratio by size (float32, along the last dim)", "",
                  sweep_table(rows)]
    parts += ["", "Plot: [sorting.png](sorting.png)", ""]
    return "\n".join(parts)


def plot(rows: list[dict], path: Path, info: dict) -> bool:
    """Bar chart of the non-sweep ratios and a line per op across the sweep sizes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[bench]'): no plot", file=sys.stderr)
        return False
    bars = [r for r in rows if r["section"] != "sweep"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, max(6, 0.28 * len(bars))),
                                   gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{r['op']} {fmt_shape(r['shape'])} {r['dtype']}"
              + (" ties" if r["section"] == "ties" else "") for r in bars][::-1]
    ratios = [r["ratio"] for r in bars][::-1]
    colors = ["tab:green" if r["met"] else "tab:red" for r in bars][::-1]
    ax1.barh(labels, ratios, color=colors)
    for i, r in enumerate(bars[::-1]):
        if r["explicit_target"]:
            ax1.plot([r["target"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
    ax1.axvline(1.0, color="grey", lw=0.8)
    ax1.axvline(FLOOR, color="red", lw=0.8, ls="--")
    ax1.set_xscale("log")
    ax1.set_xlabel("ATen ms / Kwker ms (log; black tick = target, dashed = 0.9 floor)")
    ax1.tick_params(axis="y", labelsize=7)
    shapes = [s for s in SWEEP_SHAPES]
    xs = range(len(shapes))
    for j, op in enumerate(SWEEP_OPS):
        pts = [(i, r["ratio"]) for i, s in enumerate(shapes) for r in rows
               if r["op"] == op and tuple(r["shape"]) == s and r["dtype"] == "float32"
               and r["section"] in ("sweep", "main")]
        if pts:
            ax2.plot(*zip(*pts), marker="os^v"[j % 4], color=plt.cm.tab20(j % 20), label=op)
    ax2.axhline(FLOOR, color="red", lw=0.8, ls="--")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_xticks(list(xs), [fmt_shape(s) for s in shapes], fontsize=8)
    ax2.set_ylabel("ATen ms / Kwker ms (log)")
    ax2.set_title("size sweep, float32", fontsize=10)
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Kwker vs ATen, best of >= {min(r['reps'] for r in rows) if rows else '?'}; "
                 f"{common.machine_line(info)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: fewer cases and repetitions; writes files only with --out")
    ap.add_argument("--reps", type=int, help="samples per side and round (default 5)")
    ap.add_argument("--rounds", type=int,
                    help="passes over all cases, samples spread across them (default 4, quick 1)")
    ap.add_argument("--threads", type=int, default=common.THREADS,
                    help=f"torch threads (default {common.THREADS})")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)

    import kwker.torch_ops as kto
    if kto.is_active():
        print("kwker.torch_ops is installed process-wide: ATen cannot be timed", file=sys.stderr)
        return 2
    common.set_threads(args.threads)
    info = common.machine_info()
    reps = args.reps or 5
    rounds = args.rounds or (1 if args.quick else 4)
    warmup = 1 if args.quick else 3
    print(f"# {common.machine_line(info)}; best of {reps * rounds} ({rounds} rounds)",
          flush=True)
    min_sample, budget = 2.5e-4, (0.0 if args.quick else BUDGET)
    rows = run(cases(args.quick), reps, warmup, min_sample, rounds, budget=budget)
    info["load_end"] = common.load()

    table = common.text_table(HEADERS, table_rows(rows, False))
    print("\n" + table + "\n\n" + sweep_table(rows, markdown=False) + "\n")
    for line in summary(rows):
        print(line)
    out = args.out or (None if args.quick else common.RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sorting.md").write_text(markdown(rows, info, reps, warmup, min_sample, rounds,
                                                     budget))
        common.write_json(out / "sorting.json", {
            "benchmark": "sorting", "script": "bench_sorting.py", "machine": info,
            "reps_per_round": reps, "rounds": rounds, "budget_s": budget, "warmup": warmup,
            "min_sample_s": min_sample, "threads": args.threads, "floor": FLOOR, "headline": headline(rows),
            "rows": rows})
        plot(rows, out / "sorting.png", info)
        print(f"wrote {out / 'sorting.md'}, sorting.json, sorting.png")
    if any(r["check"].startswith("MISMATCH") for r in rows):
        print("\n!!! Kwker results differ from ATen's: see the MISMATCH rows !!!", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
