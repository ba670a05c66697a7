"""float32 models under torch's float32 matmul precision: Kwker against eager at each setting.

``torch.set_float32_matmul_precision("highest" | "high" | "medium")`` changes both sides: eager's
float32 linears go to oneDNN below "highest" (bf16 products on AMX; on other CPUs float32,
sometimes faster than MKL), Kwker's take bf16 products under "medium" where the CPU has fast ones
(README, "Float32 matmul precision"). Per model and setting, in one process: eager and
``backend="kwker"`` (default inner) interleaved, best of rounds of samples
(``common.best_of_rounds``), and each side's error against the float64 model (max abs error /
max |reference|).

    python benchmarks/bench_precision.py --out benchmarks/results/<cpu>   # precision.{md,json}
    python benchmarks/bench_precision.py --quick                          # fewer reps, prints only
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from model_defs import BF16_MODELS, MODELS, build

NAMES = ("MLP 1024-4096-1024 b64", "MLP 1024-4096-1024 b1", "TransformerEncoderLayer (8,128,256)",
         "tutorial Ranker b32", "transformers BertModel 4x256 (8,128)")
SETTINGS = ("highest", "high", "medium")


def _model(name: str):
    return build(name, MODELS if name in MODELS else {k: v[0] for k, v in BF16_MODELS.items()})


def _first(out) -> torch.Tensor:
    """The tensor to compare of a model's output (transformers' output objects: the first)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.to_tuple()[0]


def _error(got, ref) -> float:
    got, ref = _first(got).double(), _first(ref).double()
    return ((got - ref).abs().max() / ref.abs().max()).item()


def run(names, reps: int, rounds: int) -> list[dict]:
    warnings.filterwarnings("ignore")
    rows = []
    for name in names:
        model, inputs = _model(name)
        with torch.no_grad():
            reference = _first(model.double()(*[x.double() if x.is_floating_point() else x
                                                 for x in inputs]))
        model.float()
        for setting in SETTINGS:
            torch.set_float32_matmul_precision(setting)
            torch._dynamo.reset()
            fast = torch.compile(model, backend="kwker")
            with torch.no_grad():
                sides = [common.Side("eager", lambda: model(*inputs)),
                         common.Side("kwker", lambda f=fast: f(*inputs))]
                eager_err = _error(model(*inputs), reference)
                kwker_err = _error(fast(*inputs), reference)
                eager_s, kwker_s = common.best_of_rounds(sides, reps, rounds)
            row = {"model": name, "precision": setting, "eager_ms": eager_s * 1e3,
                   "kwker_ms": kwker_s * 1e3, "ratio": eager_s / kwker_s,
                   "eager_error": eager_err, "kwker_error": kwker_err}
            print(f"{name:<40} {setting:<8} eager {row['eager_ms']:8.3f} ms  kwker "
                  f"{row['kwker_ms']:8.3f} ms  {row['ratio']:5.2f}x  error eager "
                  f"{eager_err:.1e} kwker {kwker_err:.1e}", flush=True)
            rows.append(row)
    torch.set_float32_matmul_precision("highest")
    return rows


def render(rows: list[dict], info: dict) -> str:
    lines = ["# float32 models under torch's float32 matmul precision", "",
             common.machine_line(info), "",
             ("Eager and `backend=\"kwker\"` at the same `torch.set_float32_matmul_precision` "
              "setting, interleaved, best of rounds; ratio = eager ms / Kwker ms. error: max abs "
              "error against the float64 model / max |reference|."), ""]
    lines.append(common.md_table(
        ["model", "precision", "eager ms", "Kwker ms", "ratio", "eager error", "Kwker error"],
        [[r["model"], r["precision"], f"{r['eager_ms']:.3f}", f"{r['kwker_ms']:.3f}",
          f"{r['ratio']:.2f}x", f"{r['eager_error']:.1e}", f"{r['kwker_error']:.1e}"]
         for r in rows]))
    return "\n".join(lines) + "\n"


def headline(rows: list[dict]) -> list[dict]:
    return [{"label": f"{r['model']} at {r['precision']} vs eager", "ratio": r["ratio"]}
            for r in rows if r["precision"] == "medium"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no results files")
    ap.add_argument("--models", nargs="+", choices=NAMES, default=list(NAMES))
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    common.set_threads()
    info = common.machine_info()
    rows = run(args.models, 3 if args.quick else 10, 1 if args.quick else 2)
    text = render(rows, info)
    print(text)
    if not args.quick:
        out = args.out or common.RESULTS
        out.mkdir(parents=True, exist_ok=True)
        (out / "precision.md").write_text(text)
        common.write_json(out / "precision.json", {"script": "bench_precision.py",
                                                    "machine": info, "rows": rows,
                                                    "headline": headline(rows)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
