"""Whole models under PyTorch eager, Inductor and the Kwker backend (both inner modes).

Speed: every variant of a model is compiled in this process, checked against eager (a speed-up
of a wrong answer is reported as such), then timed interleaved, best of N after warm-up, on 2
threads. First-compile time: ``torch.compile`` + first call in a fresh process, once with empty
Kwker and Inductor caches ("cold") and once more with the caches that run left ("warm");
importing torch and torch._dynamo is timed separately, since every backend pays it.

    python benchmarks/bench_models.py            # writes results/models.{md,json}
    python benchmarks/bench_models.py --quick    # fewer reps, prints only
    python benchmarks/bench_models.py --compile-times all   # cold/warm compile of every model

Compile times are measured for the tutorial model unless ``--compile-times all`` (each costs two
fresh processes per compiler, minutes for all models with cold Inductor caches).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

VARIANTS = ("eager", "inductor", "kwker_eager", "kwker")
LABELS = {"eager": "PyTorch eager", "inductor": "Inductor", "kwker_eager": "Kwker inner=eager",
          "kwker": "Kwker (default)"}


# --------------------------------------------------------------------------------- models
class Ranker(torch.nn.Module):
    def __init__(self, n_items=20_000, dim=128):
        super().__init__()
        self.query = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                         torch.nn.Linear(256, dim))
        self.items = torch.nn.Parameter(torch.randn(n_items, dim) / dim**0.5)

    def forward(self, x):
        scores = self.query(x) @ self.items.t()
        return torch.topk(scores, 10, dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def _ranker(b):
    return Ranker(), (torch.randn(b, 64),)


def _mlp(b):
    m = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                            torch.nn.Linear(4096, 1024))
    return m, (torch.randn(b, 1024),)


def _encoder():
    m = torch.nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024,
                                         batch_first=True, activation="gelu")
    return m, (torch.randn(8, 128, 256),)


def _sdpa(causal):
    return Attention(causal), tuple(torch.randn(8, 8, 128, 32) for _ in range(3))


MODELS = {
    "tutorial Ranker b1": lambda: _ranker(1),
    "tutorial Ranker b32": lambda: _ranker(32),
    "tutorial Ranker b256": lambda: _ranker(256),
    "MLP 1024-4096-1024 b1": lambda: _mlp(1),
    "MLP 1024-4096-1024 b64": lambda: _mlp(64),
    "TransformerEncoderLayer (8,128,256)": _encoder,
    "SDPA (8,8,128,32)": lambda: _sdpa(False),
    "SDPA causal (8,8,128,32)": lambda: _sdpa(True),
}
TUTORIAL = "tutorial Ranker b32"


def build(name: str):
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    return model.eval(), inputs


def compile_variant(model, variant: str):
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    options = {"inner": "eager"} if variant == "kwker_eager" else None
    return torch.compile(model, backend="kwker", options=options)


# ------------------------------------------------------------------------- compile times
def probe(name: str, variant: str) -> None:
    """Child process: time torch.compile + first call of one model, print JSON."""
    common.set_threads()
    t0 = time.perf_counter()
    import torch._dynamo
    t1 = time.perf_counter()
    model, inputs = build(name)
    t2 = time.perf_counter()
    compiled = compile_variant(model, variant)
    with torch.no_grad():
        compiled(*inputs)
    t3 = time.perf_counter()
    print(json.dumps({"dynamo_import_s": t1 - t0, "compile_s": t3 - t2}))


def compile_times(name: str, variant: str) -> dict:
    """{"cold": s, "warm": s, "dynamo_import_s": s} from two fresh processes."""
    out = {}
    with tempfile.TemporaryDirectory() as kw, tempfile.TemporaryDirectory() as ind:
        env = {**os.environ, "KWKER_CACHE_DIR": kw, "TORCHINDUCTOR_CACHE_DIR": ind}
        for run in ("cold", "warm"):
            res = subprocess.run([sys.executable, __file__, "--probe", name, variant],
                                 capture_output=True, text=True, env=env, check=False)
            if res.returncode != 0:
                out[run] = None
                print(res.stderr[-2000:], file=sys.stderr)
                continue
            data = json.loads(res.stdout.strip().splitlines()[-1])
            out[run] = data["compile_s"]
            out.setdefault("dynamo_import_s", data["dynamo_import_s"])
    return out


# ------------------------------------------------------------------------------- speed
def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def check(name, expected, got) -> str:
    e, g = _first(expected), _first(got)
    if not torch.allclose(g, e, rtol=1e-4, atol=1e-5):
        return f"WRONG (max diff {(g - e).abs().max().item():.2e})"
    if isinstance(expected, tuple) and len(expected) == 2 and expected[1].dtype == torch.int64:
        same = (got[1] == expected[1]).float().mean().item()
        if same < 0.99:
            return f"WRONG (indices {same:.1%} equal)"
    return "ok"


def speed(name: str, reps: int, rounds: int) -> dict:
    model, inputs = build(name)
    row = {"model": name, "ms": {}, "check": {}, "kernels": ""}
    sides = []
    with torch.no_grad():
        expected = model(*inputs)
        for variant in VARIANTS:
            torch._dynamo.reset()
            fn = compile_variant(model, variant)
            got = fn(*inputs)
            row["check"][variant] = "ok" if variant == "eager" else check(name, expected, got)
            if variant == "kwker_eager":
                import kwker.dynamo as kd
                row["kernels"] = ", ".join(kd.last_report().kernel_names)
            sides.append(common.Side(variant, lambda fn=fn: fn(*inputs), torch.no_grad))
        # a few rounds, a second apart: on a shared machine one round can be disturbed
        best = [float("inf")] * len(sides)
        for r in range(rounds):
            if r:
                time.sleep(1.0)
            best = [min(b, t) for b, t in zip(best, common.compare(sides, reps=reps, warmup=3))]
    for variant, t in zip(VARIANTS, best):
        row["ms"][variant] = t * 1e3
    return row


# ------------------------------------------------------------------------------ output
def _s(v):
    return "—" if v is None else f"{v:.1f}"


def table(rows, markdown=True):
    headers = ["model", *(LABELS[v] + " ms" for v in VARIANTS), "eager / Kwker inner=eager",
               "eager / Kwker", "compile s (cold / warm): Inductor", "Kwker inner=eager",
               "Kwker", "check"]
    body = []
    for r in rows:
        ms = r["ms"]
        ct = r.get("compile", {})
        bad = [f"{v}: {c}" for v, c in r["check"].items() if c != "ok"]
        body.append([r["model"], *(common.fmt_ms(ms[v] / 1e3) for v in VARIANTS),
                     f"{ms['eager'] / ms['kwker_eager']:.2f}x", f"{ms['eager'] / ms['kwker']:.2f}x",
                     *(f"{_s(ct.get(v, {}).get('cold'))} / {_s(ct.get(v, {}).get('warm'))}"
                       if v in ct else "—" for v in ("inductor", "kwker_eager", "kwker")),
                     "; ".join(bad) or "ok"])
    return (common.md_table if markdown else common.text_table)(headers, body)


def markdown(rows, info, reps) -> str:
    dyn = [r["compile"][v]["dynamo_import_s"] for r in rows for v in r.get("compile", {})
           if r["compile"][v].get("dynamo_import_s")]
    lines = [
        "# Models: PyTorch eager, Inductor and Kwker", "",
        f"`python benchmarks/bench_models.py` — {common.machine_line(info)}, "
        + f"{common.load()} at end.", "",
        f"Best of 3 rounds of {reps} interleaved samples after warm-up, `torch.no_grad()`, "
        "float32. Ratios "
        "are eager time / Kwker time from the same run (> 1 means Kwker is faster). Compile "
        "time is `torch.compile` + the first call in a fresh process: *cold* with empty Kwker "
        "and Inductor caches, *warm* in a second process reusing them. "
        + (f"Importing `torch._dynamo` (paid by every backend, not included) took "
           f"{min(dyn):.1f}–{max(dyn):.1f} s." if dyn else ""), "",
        table(rows), "",
        "Kernels chosen by Kwker (inner=eager) per model:", "",
        *[f"- {r['model']}: {r['kernels'] or 'none'}" for r in rows], "",
    ]
    return "\n".join(lines)


def headline(rows):
    out = []
    for r in rows:
        for v in ("kwker_eager", "kwker"):
            out.append({"label": f"{r['model']} {LABELS[v]}",
                        "ratio": r["ms"]["eager"] / r["ms"][v], "target": 1.0})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no results files")
    ap.add_argument("--compile-times", choices=("tutorial", "all", "none"), default="tutorial")
    ap.add_argument("--models", nargs="*", help="subset of model names")
    ap.add_argument("--probe", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=f"results directory (default {common.RESULTS})")
    args = ap.parse_args(argv)
    if args.probe:
        probe(*args.probe)
        return 0
    common.set_threads()
    info = common.machine_info()
    reps = 5 if args.quick else 20
    names = args.models or list(MODELS)
    rows = []
    for name in names:
        row = speed(name, reps, 1 if args.quick else 3)
        if args.compile_times == "all" or (args.compile_times == "tutorial" and name == TUTORIAL):
            row["compile"] = {v: compile_times(name, v) for v in ("inductor", "kwker_eager",
                                                                  "kwker")}
        rows.append(row)
        print(table([row], markdown=False).splitlines()[-1], flush=True)
    print()
    print(table(rows, markdown=False))
    out = args.out or (None if args.quick else common.RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "models.md").write_text(markdown(rows, info, reps))
        common.write_json(out / "models.json", {"machine": info, "reps": reps, "rows": rows,
                                                "headline": headline(rows)})
        print(f"wrote {out / 'models.md'} and models.json")
    wrong = [r["model"] for r in rows if any(c != "ok" for c in r["check"].values())]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
