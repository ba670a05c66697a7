"""Full-size transformers models (BERT-base, GPT-2, a Llama and a Qwen3-MoE of GPT-2's size)
compiled whole.

- float32 (issue 19's target): ``backend="kwker"`` >= 1.3x eager as a geomean over BERT-base,
  GPT-2 and the Llama, none below 1.0x (the MoE too). Eager, Inductor and Kwker (inner eager
  and default) are checked against eager first, then timed interleaved, best of rounds
  (``common.best_of_rounds``).
- bfloat16 (``--dtypes bfloat16``; the AMX issue's BERT-base and GPT-2 targets on a CPU with
  AMX): each model as ``.to(bfloat16)`` and under autocast, with OpenVINO bf16 side by side and
  the bf16 accuracy contract, through the bf16 section's machinery (models_bf16.py).

Models are built from transformers' configs with random weights (no download), BERT-base at
8 x 128 tokens, the others at 1 x 128, no KV cache; 2 threads, ``torch.no_grad()``.

    python benchmarks/bench_transformers.py --out benchmarks/results/<cpu>  # transformers.{md,json}
    python benchmarks/bench_transformers.py --dtypes float32 bfloat16      # both sections
    python benchmarks/bench_transformers.py --quick                          # prints only
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from statistics import geometric_mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import models_bf16
import peers
from bench_models import speed
from model_defs import TRANSFORMERS, TRANSFORMERS_GEOMEAN, TRANSFORMERS_TARGETS_AMX, Missing

VARIANTS = ("eager", "inductor", "kwker_eager", "kwker")
LABELS = {"eager": "eager", "inductor": "Inductor", "kwker_eager": "Kwker inner=eager",
          "kwker": "Kwker (default)"}
TARGET, FLOOR = 1.3, 1.0   # float32: geomean of eager / Kwker over the models, and the least


def _lowering(lo: dict) -> str:
    """What a Kwker compile lowered (models_bf16.lowering), in one line."""
    fell = f", {len(lo['fallback'])} fell back" if lo["fallback"] else ""
    return (f"{lo['kernels']} kernels in {lo['graphs']} graph(s), {lo['inner_nodes']} nodes "
            f"inner, {len(lo['missed'])} missed{fell}")


def measure_f32(name: str, reps: int, rounds: int) -> dict:
    """One float32 row: every variant checked against eager, then timed interleaved
    (bench_models.speed, without the peers)."""
    row = speed(name, reps, rounds, peers=(), models={k: v[0] for k, v in TRANSFORMERS.items()},
                variants=VARIANTS)
    row["ratio"] = row["ms"]["eager"] / row["ms"]["kwker"]
    print(f"{name:<26} " + "  ".join(f"{LABELS[v]} {row['ms'][v]:.1f} ms" for v in VARIANTS)
          + f"  eager/Kwker {row['ratio']:.2f}x  {_lowering(row['lowering']['kwker'])}",
          flush=True)
    return row


def _geomean(rows: list[dict]) -> tuple[float, list[str]]:
    """(geomean of eager / Kwker over the target's models present, their names)."""
    named = [r for r in rows if r["model"] in TRANSFORMERS_GEOMEAN]
    geo = geometric_mean(r["ratio"] for r in named) if named else float("nan")
    return geo, [r["model"] for r in named]


def f32_summary(rows: list[dict]) -> str:
    (geo, names), least = _geomean(rows), min(r["ratio"] for r in rows)
    met = "met" if geo >= TARGET and least >= FLOOR else "NOT met"
    return (f"float32: geomean **{geo:.2f}x** eager over {len(names)} models ("
            f"{', '.join(names)}), least {least:.2f}x over all {len(rows)} (target >= {TARGET}x, "
            f"none below {FLOOR}x: {met}).")


def f32_table(rows: list[dict]) -> str:
    def x(r, v):
        return f"{r['ms']['eager'] / r['ms'][v]:.2f}x"
    return common.md_table(
        ["model", *(f"{LABELS[v]} ms" for v in VARIANTS), "eager / Inductor",
         "eager / Kwker inner=eager", "eager / Kwker", "compile s (Inductor / Kwker)", "check",
         "Kwker lowered"],
        [[r["model"], *(f"{r['ms'][v]:.1f}" for v in VARIANTS), x(r, "inductor"),
          x(r, "kwker_eager"), f"**{x(r, 'kwker')}**",
          f"{r['compile_s']['inductor']:.1f} / {r['compile_s']['kwker']:.1f}",
          " / ".join(sorted(set(r["check"].values()))), _lowering(r["lowering"]["kwker"])]
         for r in rows])


def render(f32: list[dict], bf16: list[dict], info: dict, skipped: dict) -> str:
    lines = ["# Full-size transformers models: eager, Inductor and Kwker", "",
             common.machine_line(info), ""]
    lines += [f"- {n}: not run ({why})" for n, why in skipped.items()]
    if f32:
        lines += ["## float32", "",
                  ("Random weights from transformers' configs, `torch.no_grad()`, best of "
                   "interleaved rounds; ratio = eager ms / Kwker ms (> 1: Kwker is faster). "
                   "check: within rtol 1e-4 / atol 1e-5 of eager. compile s: `torch.compile` + "
                   "the first call in this process (Kwker's kernel cache as the run found it)."),
                  "", f32_summary(f32), "", f32_table(f32), ""]
    if bf16:
        lines += ["## bfloat16", "", models_bf16.METHOD, "", models_bf16.speed_table(bf16), "",
                  models_bf16.accuracy_table(bf16), "", *models_bf16.notes(bf16), ""]
        bad = models_bf16.broken(bf16)
        if bad:
            lines += ["**Accuracy contract broken:**", "", *(f"- {b}" for b in bad), ""]
    return "\n".join(lines) + "\n"


def headline(f32: list[dict], bf16: list[dict]) -> list[dict]:
    out = []
    if f32:
        out.append({"label": "transformers models float32, geomean vs eager",
                    "ratio": _geomean(f32)[0], "target": TARGET})
    out += [h for h in models_bf16.headline({"rows": bf16}) if not h["label"].startswith("AVX2")]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no results files")
    ap.add_argument("--models", nargs="+", choices=list(TRANSFORMERS), default=list(TRANSFORMERS))
    ap.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                    default=["float32", "bfloat16"])
    ap.add_argument("--no-peers", action="store_true", help="bf16: without OpenVINO")
    ap.add_argument("--max-autotune", action="store_true",
                    help="bf16: also Inductor with freezing and max-autotune (minutes a model)")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    common.set_threads()
    info = common.machine_info()
    reps, rounds = (2, 1) if args.quick else (5, 3)
    f32, bf16, skipped = [], [], {}
    if "float32" in args.dtypes:
        for name in args.models:
            try:
                f32.append(measure_f32(name, reps, rounds))
            except Missing as e:
                skipped[name] = str(e)
    if "bfloat16" in args.dtypes:
        bf16 = models_bf16.run(args.models, reps, rounds, () if args.no_peers else peers.PEERS,
                               max_autotune=args.max_autotune, models=TRANSFORMERS,
                               amx_targets=TRANSFORMERS_TARGETS_AMX)
    text = render(f32, bf16, info, skipped)
    print(text)
    if not args.quick and (f32 or bf16):
        out = args.out or common.RESULTS
        out.mkdir(parents=True, exist_ok=True)
        (out / "transformers.md").write_text(text)
        common.write_json(out / "transformers.json", {
            "script": "bench_transformers.py", "machine": info, "float32": f32, "bf16": bf16,
            "headline": headline(f32, bf16)})
    wrong = any(c != "ok" for r in f32 for c in r["check"].values())
    return 1 if wrong or models_bf16.broken(bf16) else 0


if __name__ == "__main__":
    sys.exit(main())
