"""Timing and reporting helpers shared by the benchmark scripts.

The machine is shared and noisy, so every comparison is *interleaved* (one sample of each side in
turn, the order alternating every repetition) and reported as the best of N samples after a
warm-up: the minimum is the least disturbed estimate of what the code itself costs, and
interleaving exposes both sides to the same background load.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import torch

THREADS = 2
RESULTS = Path(__file__).resolve().parent / "results"


# the best PyTorch peer on a CPU (issue 18), on request: Inductor with frozen weights and its
# own CPP GEMM templates (AMX micro-kernels on such CPUs) or ATen's, autotuned (minutes a model)
MAX_AUTOTUNE_OPTIONS = {"freezing": True, "max_autotune": True,
                        "max_autotune_gemm_backends": "CPP,ATEN"}


def set_threads(n: int = THREADS) -> int:
    """Pin torch's intra-op threads (the figures in the docs are all taken with 2)."""
    torch.set_num_threads(n)
    return torch.get_num_threads()


def cpu_name() -> str:
    """LLVM's name for the host CPU (what Kwker compiles for), its widest vector ISA, and AMX."""
    try:
        import llvmlite.binding as llvm

        name = llvm.get_host_cpu_name()
        feats = llvm.get_host_cpu_features()
        isa = ("AVX-512" if feats.get("avx512f") else "AVX2" if feats.get("avx2") else "SSE")
        if feats.get("amx-bf16"):
            isa += ", AMX"
        return f"{name} ({isa})"
    # a report without the CPU name is still worth writing
    except (ImportError, OSError, RuntimeError) as exc:
        return f"unknown ({type(exc).__name__})"


def machine_info() -> dict:
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load": load(),
        "commit": commit(),
    }


def commit() -> str:
    """The checkout measured: short hash, '+dirty' when kwker/ has uncommitted edits."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kwker"], cwd=root,
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + ("+dirty" if dirty else "")


def load() -> str:
    """1/5/15-minute load averages: on a shared 2-core machine they explain noisy figures."""
    try:
        return "/".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "?"


def machine_line(info: dict | None = None) -> str:
    i = info or machine_info()
    return (f"CPU {i['cpu']}, {i['cores']} cores; torch {i['torch']}; "
            f"{i['threads']} threads; Python {i['python']}; {i['date']}; "
            f"kwker {i.get('commit', '?')}; load {i.get('load', '?')} at start")


def runs_note(rows, info: dict) -> list[str]:
    """A line naming the rows measured in another run than the header's, if any."""
    here = f"{info['date']}, kwker {info.get('commit', '?')}"
    other = []
    for r in rows:
        if r.get("run") != here:
            mode = f" {r['mode']}" if r.get("mode") else ""
            other.append(f"{r['model']}{mode} ({r.get('run', 'an earlier run')})")
    if not other:
        return []
    return [f"Rows from earlier runs (a `--models` run updated the others): {'; '.join(other)}.",
            ""]


# ------------------------------------------------------------------------------------ timing
@dataclass
class Side:
    """One contender: a zero-argument call, run inside ``context()`` (e.g. kto.accelerated)."""

    name: str
    fn: Callable[[], object]
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    samples: list[float] = field(default_factory=list)  # seconds per call
    prime: bool = False  # each sample's first call, right after entering context(), untimed
    pool: str = "torch"  # whose worker threads its calls run on (a peer's own thread pool)

    @property
    def best(self) -> float:
        return min(self.samples)


# seconds of untimed calls before each sample where peers run (``settle``): a KVM guest idle for
# 40 ms ran its next ~20 ms of work slowly (Intel Xeon with AMX, tutorial Ranker b32 compiled,
# best of 20 samples of 4 calls: 425 us back to back, 540 after the pause and one untimed call,
# 450 after 5 ms of them, 367-377 after 20-50 ms; eager 1560 / 1772 / 1609 / 1516-1549), and a
# side's first call finds its weights evicted by the sides before it
WAKE = 0.02


def _sample(side: Side, number: int, settle: float = 0.0, pause: bool = True) -> float:
    """Seconds per call over ``number`` back-to-back calls (context entered outside the clock).

    ``settle`` > 0: first sleep that long (where ``pause``), then make untimed calls for
    ``WAKE`` seconds (at least one). Sides running their own thread pools (ONNX Runtime's
    workers spin ~30 ms after a call, OpenMP's a few ms) would otherwise steal a core from the
    side timed next; after the pause they are idle, and the untimed calls wake this side's own
    threads and the machine, and bring its weights back into the caches as every side's are
    (the sides before it read their own copies). ``side.prime``: one untimed call too (the
    first call after entering the context is then not what a sample measures).
    """
    with side.context():
        if settle:
            if pause:
                time.sleep(settle)
            start = time.perf_counter()
            side.fn()
            while time.perf_counter() - start < WAKE:
                side.fn()
        elif side.prime:
            side.fn()
        t0 = time.perf_counter()
        for _ in range(number):
            side.fn()
        return (time.perf_counter() - t0) / number


# A comparison spends at most about this long sampling (beyond warm-up), with at least MIN_REPS
# samples a side, and a call this slow is warmed up once: eager bf16 of a 12-layer encoder on a
# CPU without AVX512_BF16 takes 9.7 s a call (Zen 3), and 3 rounds of 20 samples of it alone
# took bench_models past 25 minutes
# a round stops sampling after ROUND_BUDGET seconds (at least MIN_REPS samples a side): the
# 12-layer bf16 encoder's rows (0.45 s a call, five sides) took 74 s each with 30, and a full
# bench_models.py run 15.3 minutes on Zen 4 against issue 18's budget of 15
ROUND_BUDGET, MIN_REPS, SLOW_CALL = 15.0, 3, 1.0
ROUND_GAP = 0.5   # seconds between rounds (a disturbance of the machine passes)


def calibrate(sides: Sequence[Side], warmup: int = 3, min_sample: float = 2e-3) -> int:
    """Warm every side up; return how many back-to-back calls make one sample.

    Tiny calls are repeated until one sample takes ``min_sample`` seconds, so the clock's
    resolution and the context switch do not dominate.
    """
    for side in sides:
        side.samples.clear()
        for _ in range(warmup):
            if _sample(side, 1) > SLOW_CALL:
                break
    one = min(_sample(s, 1) for s in sides)
    return max(1, min(10_000, math.ceil(min_sample / max(one, 1e-7))))


def sample_round(sides: Sequence[Side], reps: int, number: int, budget: float = 0.0,
                 max_factor: int = 4, settle: float = 0.0) -> float:
    """``reps`` samples of every side, interleaved, the order alternating each time (fewer,
    down to ``MIN_REPS``, once ``ROUND_BUDGET`` seconds have gone); the seconds spent.

    Cheap calls get more samples (until ``budget`` seconds have been spent, at most
    ``max_factor * reps``): on a loaded machine a short sample is more likely to fall in a quiet
    moment, and the best of many cheap samples is worth the little time it costs.
    """
    t0, r, pool = time.perf_counter(), 0, None
    while r < reps or (r < max_factor * reps and time.perf_counter() - t0 < budget):
        if r >= MIN_REPS and time.perf_counter() - t0 > ROUND_BUDGET:
            break
        for side in (sides if r % 2 == 0 else reversed(sides)):
            # a pause only where the thread pool changes: torch's sides share one
            side.samples.append(_sample(side, number, settle, pause=side.pool != pool))
            pool = side.pool
        r += 1
    return time.perf_counter() - t0


def compare(sides: Sequence[Side], reps: int = 20, warmup: int = 3,
            min_sample: float = 2e-3, settle: float = 0.0) -> list[float]:
    """Best seconds per call of each side over ``reps`` interleaved samples after warm-up
    (``settle``: see ``_sample``)."""
    return _compare_timed(sides, reps, warmup, settle, min_sample)[0]


def _compare_timed(sides, reps, warmup, settle, min_sample=2e-3) -> tuple[list[float], float]:
    """``compare`` and the seconds its sampling took."""
    spent = sample_round(sides, reps, calibrate(sides, warmup, min_sample), settle=settle)
    return [s.best for s in sides], spent


def best_of_rounds(sides: Sequence[Side], reps: int, rounds: int,
                   settle: float = 0.0) -> list[float]:
    """Best seconds per call of each side over a few interleaved rounds (``compare``),
    ``ROUND_GAP`` apart (on a shared machine one round can be disturbed); one round where it ran
    past ``ROUND_BUDGET``."""
    best = [float("inf")] * len(sides)
    for r in range(rounds):
        if r:
            time.sleep(ROUND_GAP)
        times, spent = _compare_timed(sides, reps, 3, settle)
        best = [min(b, t) for b, t in zip(best, times)]
        if spent > ROUND_BUDGET:  # a slow row: more rounds would cost minutes each
            break
    return best


def contexts(*makers: Callable[[], AbstractContextManager]) -> Callable[[], AbstractContextManager]:
    """One context factory entering every ``makers()`` in order (e.g. no_grad + autocast)."""
    @contextlib.contextmanager
    def both():
        with contextlib.ExitStack() as stack:
            for make in makers:
                stack.enter_context(make())
            yield
    return both


# ------------------------------------------------------------------------------------ output
def add_out_argument(ap) -> None:
    """Every script's ``--out``: the directory its tables, JSON and plots go to."""
    ap.add_argument("--out", type=Path, default=None,
                    help=f"results directory (default {RESULTS}; other CPU types: "
                    "results/<cpu>/; with --quick, none unless given)")


def md_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (no dependency on tabulate)."""
    def cell(v):
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The same table aligned for a terminal."""
    cols = [list(map(str, c)) for c in zip(headers, *rows)]
    widths = [max(len(v) for v in c) for c in cols]
    out = [headers] + [list(map(str, r)) for r in rows]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in out]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


# ------------------------------------------------------------------------------------ plots
def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note) when matplotlib is
    missing: plots are optional (the ``bench`` extra), tables are not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib is not installed (pip install -e ".[bench]"): no plot', file=sys.stderr)
        return None
    return plt


def ratio_bars(ax, labels: Sequence[str], ratios: Sequence[float],
               targets: Sequence[float | None] = (), colors: Sequence[str] = (),
               notes: Sequence[str] = ()) -> None:
    """Horizontal bars of ratios, first label on top, log x; each bar's value (and note) at its
    end, a black tick per target, a grey line at 1 (a tie)."""
    n = len(labels)
    ys = [n - 1 - i for i in range(n)]
    ax.barh(ys, ratios, color=list(colors) or "tab:blue")
    for y, t in zip(ys, targets):
        if t is not None:
            ax.plot([t, t], [y - 0.4, y + 0.4], color="black", lw=2)
    notes = list(notes) + [""] * (n - len(notes))
    for y, r, note in zip(ys, ratios, notes):
        ax.text(r * 1.03, y, f"{r:.2f}x" + (f", {note}" if note else ""), va="center",
                fontsize=7)
    ax.axvline(1.0, color="grey", lw=0.8)
    log_x(ax, right=max([*ratios, *(t for t in targets if t)]) * 1.8)
    ax.set_yticks(ys, labels, fontsize=8)


def log_x(ax, right: float | None = None) -> None:
    """A log x axis labelled 0.5x, 1x, 2x... instead of powers of ten."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    if right:
        ax.set_xlim(right=right)
    fmt = FuncFormatter(lambda v, _: f"{v:g}x")
    ax.xaxis.set_major_formatter(fmt)
    ax.xaxis.set_minor_formatter(fmt)
    ax.tick_params(axis="x", which="both", labelsize=7)


def save_plot(fig, path: Path, title: str) -> bool:
    """Title, tight layout, write the PNG, release the figure."""
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return True


def rss_mb() -> float:
    """Resident set size of this process (VmRSS), MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")
