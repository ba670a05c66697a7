"""Full-size transformers models (BERT-base, GPT-2, a Llama of GPT-2's size) compiled whole.

Issue 19's float32 target: ``backend="kwker"`` >= 1.3x eager as a geomean over BERT-base, GPT-2
and Llama, none below 1.0x. Each model is built from transformers' config with random weights
(no download), called on 1 x 128 tokens, and run as PyTorch eager, Inductor and Kwker (inner
eager and default); every compiled variant is checked against eager first, then all are timed
interleaved, best of rounds (``common.best_of_rounds``), 2 threads, ``torch.no_grad()``.
``--dtypes bfloat16`` adds each model as ``.to(bfloat16)`` against eager bf16, checked with the
bf16 accuracy contract (models_bf16.py: error against the float32 model <= 1.25 x eager bf16's
+ 1e-3 x max |reference|).

    python benchmarks/bench_transformers.py --out benchmarks/results/<cpu>  # transformers.{md,json}
    python benchmarks/bench_transformers.py --quick                          # prints only
"""
from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from bench_models import check, compile_variant
from model_defs import TRANSFORMERS, Missing
from models_bf16 import ERR_ABS, ERR_FACTOR

VARIANTS = ("eager", "inductor", "kwker_eager", "kwker")
LABELS = {"eager": "eager", "inductor": "Inductor", "kwker_eager": "Kwker inner=eager",
          "kwker": "Kwker (default)"}
TARGET, FLOOR = 1.3, 1.0   # geomean of eager / Kwker over the models, and every model's least


def _bf16_check(out, ref32, eager_out) -> str:
    """The bf16 contract against the float32 model's output ``ref32``."""
    err = (out.double() - ref32.double()).abs().max().item()
    bound = ERR_FACTOR * (eager_out.double() - ref32.double()).abs().max().item() \
        + ERR_ABS * ref32.abs().max().item()
    return "ok" if err <= bound else f"BROKEN (error {err:.2e} > {bound:.2e})"


def _lowering() -> str:
    """What the last Kwker compile lowered: kernels, nodes left to the inner compiler, missed."""
    import kwker.dynamo as kd
    reports = [r for r in kd.all_reports() if r.status == "lowered"]
    if not reports:
        return "nothing lowered"
    kernels = sum(len(r.kernels) for r in reports)
    inner = sum(len(r.inner_nodes) for r in reports)
    missed = sum(len(r.missed) for r in reports)
    return f"{kernels} kernels in {len(reports)} graph(s), {inner} nodes inner, {missed} missed"


def measure(name: str, dtype: str, reps: int, rounds: int) -> dict:
    import kwker.dynamo as kd
    torch.manual_seed(0)
    model, inputs = TRANSFORMERS[name]()
    model.eval()
    row = {"model": name, "dtype": dtype, "ms": {}, "check": {}, "compile_s": {}}
    with torch.no_grad():
        ref32 = model(*inputs)
        if dtype == "bfloat16":
            model = copy.deepcopy(model).to(torch.bfloat16)
        expected = model(*inputs)
        sides = []
        for variant in VARIANTS:
            torch._dynamo.reset()
            kd.clear_reports()
            t0 = time.perf_counter()
            fn = compile_variant(model, variant, inputs)
            got = fn(*inputs)
            row["compile_s"][variant] = time.perf_counter() - t0
            if variant == "eager":
                row["check"][variant] = "ok"
            elif dtype == "float32":
                row["check"][variant] = check(name, expected, got)
            else:
                row["check"][variant] = _bf16_check(got, ref32, expected)
            if variant == "kwker":
                row["lowering"] = _lowering()
            sides.append(common.Side(variant, lambda fn=fn: fn(*inputs), torch.no_grad))
        for side, t in zip(sides, common.best_of_rounds(sides, reps, rounds)):
            row["ms"][side.name] = t * 1e3
    row["ratio"] = row["ms"]["eager"] / row["ms"]["kwker"]
    row["ratio_inner_eager"] = row["ms"]["eager"] / row["ms"]["kwker_eager"]
    row["ratio_inductor"] = row["ms"]["eager"] / row["ms"]["inductor"]
    print(f"{name:<26} {dtype:<9} " + "  ".join(
        f"{LABELS[v]} {row['ms'][v]:.1f} ms" for v in VARIANTS)
        + f"  eager/Kwker {row['ratio']:.2f}x  {row['lowering']}", flush=True)
    return row


def _geo(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summary(rows: list[dict], dtype: str) -> dict | None:
    mine = [r for r in rows if r["dtype"] == dtype]
    if not mine:
        return None
    best = [max(r["ratio"], r["ratio_inner_eager"]) for r in mine]
    return {"dtype": dtype, "geomean": _geo([r["ratio"] for r in mine]),
            "geomean_best": _geo(best), "least": min(r["ratio"] for r in mine),
            "models": len(mine)}


def render(rows: list[dict], info: dict, skipped: dict) -> str:
    lines = ["# Full-size transformers models: eager, Inductor and Kwker", "",
             common.machine_line(info), "",
             ("1 x 128 tokens, random weights from transformers' configs, `torch.no_grad()`, "
              "best of interleaved rounds; ratio = eager ms / Kwker (default inner) ms, > 1 "
              "means Kwker is faster. check: float32 within rtol 1e-4 / atol 1e-5 of eager; "
              "bf16 the bf16 contract against the float32 model. compile s: `torch.compile` + "
              "the first call in this process (Kwker's kernel cache as the run found it)."), ""]
    for dtype in ("float32", "bfloat16"):
        s = summary(rows, dtype)
        if s is None:
            continue
        target = (f" (target >= {TARGET}x, none below {FLOOR}x: "
                  f"{'met' if s['geomean'] >= TARGET and s['least'] >= FLOOR else 'NOT met'})"
                  if dtype == "float32" else "")
        lines.append(f"- {dtype}: geomean **{s['geomean']:.2f}x** eager over {s['models']} "
                     f"models{target}; least {s['least']:.2f}x.")
    lines += [f"- {n}: not run ({why})" for n, why in skipped.items()]
    lines += ["", common.md_table(
        ["model", "dtype", *(f"{LABELS[v]} ms" for v in VARIANTS), "eager / Inductor",
         "eager / Kwker inner=eager", "eager / Kwker", "compile s (Inductor / Kwker)",
         "check", "Kwker lowered"],
        [[r["model"], r["dtype"], *(f"{r['ms'][v]:.1f}" for v in VARIANTS),
          f"{r['ratio_inductor']:.2f}x", f"{r['ratio_inner_eager']:.2f}x",
          f"**{r['ratio']:.2f}x**",
          f"{r['compile_s']['inductor']:.1f} / {r['compile_s']['kwker']:.1f}",
          " / ".join(sorted(set(r["check"].values()))), r["lowering"]] for r in rows])]
    return "\n".join(lines) + "\n"


def headline(rows: list[dict]) -> list[dict]:
    out = []
    for dtype in ("float32", "bfloat16"):
        s = summary(rows, dtype)
        if s:
            out.append({"label": f"transformers models {dtype}, geomean vs eager",
                        "ratio": s["geomean"], **({"target": TARGET} if dtype == "float32"
                                                  else {})})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no results files")
    ap.add_argument("--models", nargs="+", choices=list(TRANSFORMERS), default=list(TRANSFORMERS))
    ap.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32"])
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    common.set_threads()
    info = common.machine_info()
    reps, rounds = (2, 1) if args.quick else (5, 3)
    rows, skipped = [], {}
    for dtype in args.dtypes:
        for name in args.models:
            try:
                rows.append(measure(name, dtype, reps, rounds))
            except Missing as e:
                skipped[name] = str(e)
    text = render(rows, info, skipped)
    print(text)
    if not args.quick and rows:
        out = args.out or common.RESULTS
        out.mkdir(parents=True, exist_ok=True)
        (out / "transformers.md").write_text(text)
        common.write_json(out / "transformers.json", {
            "script": "bench_transformers.py", "machine": info, "rows": rows,
            "headline": headline(rows)})
    return 0 if all(c == "ok" for r in rows for c in r["check"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
