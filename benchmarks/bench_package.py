"""Ahead-of-time packages (``kwker.package`` / ``kwker.load_package``) against the ways a user
could serve the same model: ``torch.compile`` with Kwker (inner eager and default), ONNX Runtime
and eager, 2 threads, ``torch.no_grad()``, interleaved best-of timing (common.py).

- ``calls``: the tutorial Ranker exported with its batch dynamic (1..256) at b1 and b32, and
  MLP 1024-4096-1024 (batch 1..1024) at b1; the package's own cost per call over its kernels
  (``overhead_us``).
- ``startup``: a fresh process with an empty kernel cache: ``import torch`` (reported apart),
  then ``import kwker`` + ``load_package`` + the first call; whether dynamo was imported and
  whether anything compiled. Best of 3 processes.

    python benchmarks/bench_package.py            # writes results/package.{md,json}
    python benchmarks/bench_package.py --quick    # fewer reps, prints only
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from model_defs import Ranker, _mlp
from peers import export_onnx, onnxruntime_call, peer_missing

import kwker

TARGETS = {("Ranker", 1): {"kwker_eager": 1.5, "onnxruntime": 1.5},
           ("Ranker", 32): {"kwker_eager": 1.05}, ("MLP", 1): {"kwker_eager": 1.3}}
STARTUP_S, OVERHEAD_US = 1.0, 5.0
LABELS = {"package": "Kwker package", "kwker_eager": "torch.compile kwker inner=eager",
          "kwker": "torch.compile kwker (default)", "onnxruntime": "ONNX Runtime",
          "eager": "eager", "read_floor": "reading the weights once (floor)"}

STARTUP = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import kwker
model = kwker.load_package(sys.argv[1])
t2 = time.perf_counter()
out = model(torch.randn(1, 64))
t3 = time.perf_counter()
from kwker.runtime.kernel import stats
print(json.dumps({"import_torch": t1 - t0, "load": t2 - t1, "first_call": t3 - t2,
                  "total": t3 - t1, "dynamo": "torch._dynamo" in sys.modules,
                  "compiles": stats["misses"], "packaged": stats["packaged"]}))
"""


def models():
    torch.manual_seed(0)
    ranker = Ranker().eval()
    mlp = _mlp(1)[0].eval()
    return {"Ranker": (ranker, 64, 256), "MLP": (mlp, 1024, 1024)}


def build_package(model, features: int, max_batch: int, folder: Path) -> Path:
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    ep = torch.export.export(model, (torch.randn(4, features),), dynamic_shapes=({0: batch},))
    return kwker.package(ep, folder / "model.kwk")


def overhead_us(pkg, x, reps: int) -> tuple[float, float]:
    """(call, cost over the kernels) in microseconds, timed directly: the same package with
    each kernel step replaced by one that stores the kernel's answer (computed once) runs
    everything else a call does: input checks, autograd switch, slots, ATen steps, outputs."""
    import copy
    program = pkg._program
    env = program.template.copy()
    env[:program.n_inputs] = [x]
    stubbed = []
    for step, dead in program.steps:
        if hasattr(step, "kernel"):
            before = list(env)
            step(env)
            slot = next(i for i, (a, b) in enumerate(zip(before, env)) if a is not b)
            step = _stored(slot, env[slot])
        else:
            step(env)
        stubbed.append((step, dead))
    rest = copy.copy(pkg)
    rest._program = copy.copy(program)
    rest._program.steps = stubbed
    sides = [common.Side("call", lambda: pkg(x)), common.Side("rest", lambda: rest(x))]
    call, over = common.best_of_rounds(sides, reps, 3)
    return call * 1e6, over * 1e6


def _stored(slot: int, value):
    def step(env):
        env[slot] = value
    return step


def calls(reps: int, quick: bool) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kwker-pkg-bench-") as tmp, torch.no_grad():
        for name, (model, features, max_batch) in models().items():
            folder = Path(tmp) / name
            folder.mkdir()
            batches = (1, 32) if name == "Ranker" else (1,)
            inputs = {b: torch.randn(b, features) for b in batches}
            # torch.compile first, as in a process of its own: built after the package, its
            # static sizes would reuse the package's generic kernels (the no-stall rule)
            compiled = {}
            for b, x in inputs.items():
                for v, opts in (("kwker_eager", {"inner": "eager"}), ("kwker", {})):
                    c = torch.compile(model, backend="kwker", options=opts)
                    c(x), c(x)
                    compiled[b, v] = c
            pkg = kwker.load_package(build_package(model, features, max_batch, folder))
            for b, x in inputs.items():
                variants = {"package": lambda pkg=pkg, x=x: pkg(x)}
                for v in ("kwker_eager", "kwker"):
                    variants[v] = (lambda c=compiled[b, v], x=x: c(x))
                missing = peer_missing("onnxruntime")
                if missing is None:
                    path = str(folder / f"b{b}.onnx")
                    how = export_onnx(model, (x,), path)
                    variants["onnxruntime"] = onnxruntime_call(
                        model, (x,), lambda path=path, how=how: (path, how))[0]
                variants["eager"] = lambda model=model, x=x: model(x)
                if name == "MLP":
                    variants["read_floor"] = read_floor(model)
                sides = [common.Side(k, f, pool=k if k == "onnxruntime" else "torch")
                         for k, f in variants.items()]
                best = common.best_of_rounds(sides, reps, 1 if quick else 3, settle=0.05)
                us = {s.name: t * 1e6 for s, t in zip(sides, best)}
                call, over = overhead_us(pkg, x, reps)
                rows.append({"model": name, "batch": b, "us": us,
                             "ratios": {k: v / us["package"] for k, v in us.items()},
                             "overhead": {"call_us": call, "over_us": over},
                             "kernels": pkg.report.kernel_sizes})
                print(f"{name} b{b}: " + ", ".join(f"{k} {v:.1f} us" for k, v in us.items())
                      + f"; cost over the kernels {over:.2f} us")
    return rows


def read_floor(model):
    """A call reading as many bytes as the model's weights once, on the same threads (the JIT'd
    read probe of probes.py): the memory floor of a batch-1 call, which reads each weight
    once. The buffer is larger than the L3, as the weights are."""
    import probes

    from kwker.codegen import simd
    from kwker.runtime.target import host_target
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fn = probes.read_probe(simd.float_lanes(host_target()))
    buf = torch.ones(nbytes // 4)
    sink = torch.zeros(64)
    args = (buf.data_ptr(), buf.numel(), 1, sink.data_ptr(), torch.get_num_threads())
    return lambda keep=(buf, sink): fn(*args)  # the buffers live as long as the call


def startup(runs: int = 3) -> dict:
    with tempfile.TemporaryDirectory(prefix="kwker-pkg-start-") as tmp:
        torch.manual_seed(0)
        path = build_package(Ranker().eval(), 64, 256, Path(tmp))
        best = None
        for i in range(runs):
            env = {**os.environ, "KWKER_CACHE_DIR": os.path.join(tmp, f"cache{i}")}
            r = subprocess.run([sys.executable, "-c", STARTUP, str(path)], env=env,
                               capture_output=True, text=True, check=True)
            got = json.loads(r.stdout.strip().splitlines()[-1])
            if best is None or got["total"] < best["total"]:
                best = got
        best["package_mb"] = path.stat().st_size / 2**20
    print(f"startup: import torch {best['import_torch']:.3f} s; import kwker + load + first "
          f"call {best['total']:.3f} s; dynamo imported: {best['dynamo']}; compiles: "
          f"{best['compiles']}")
    return best


def targets(rows, start) -> list[dict]:
    out = []
    for r in rows:
        for v, want in TARGETS.get((r["model"], r["batch"]), {}).items():
            got = r["ratios"].get(v)
            out.append({"what": f"{r['model']} b{r['batch']}: package vs {LABELS[v]}",
                        "target": f">= {want}x", "measured": None if got is None else
                        f"{got:.2f}x", "met": got is not None and got >= want})
        out.append({"what": f"{r['model']} b{r['batch']}: cost per call over the kernels",
                    "target": f"<= {OVERHEAD_US} us",
                    "measured": f"{r['overhead']['over_us']:.2f} us",
                    "met": r["overhead"]["over_us"] <= OVERHEAD_US})
    out.append({"what": "fresh process: import kwker + load_package + first call",
                "target": f"<= {STARTUP_S} s, no dynamo, no compile",
                "measured": f"{start['total']:.3f} s, dynamo {start['dynamo']}, "
                            f"{start['compiles']} compiles",
                "met": start["total"] <= STARTUP_S and not start["dynamo"]
                and start["compiles"] == 0})
    return out


def headline(rows, start) -> list[dict]:
    """For the results index: the package against the targets' baselines, and startup."""
    out = []
    for r in rows:
        for v, want in TARGETS.get((r["model"], r["batch"]), {}).items():
            if v in r["ratios"]:
                out.append({"label": f"{r['model']} b{r['batch']} package vs {LABELS[v]}",
                            "ratio": r["ratios"][v], "target": want})
    out.append({"label": f"fresh process, import kwker + load + first call in "
                         f"{start['total']:.2f} s: 1 s budget / that", "ratio":
                STARTUP_S / start["total"], "target": 1.0})
    return out


def markdown(data) -> str:
    m = data["machine"]
    lines = ["# Ahead-of-time packages", "",
             f"`benchmarks/bench_package.py`; {common.machine_line(m)}.", "",
             "Microseconds per call (best of interleaved samples, 2 threads, no_grad); the "
             "ratio is each variant's time over the package's (> 1: the package is faster). "
             "Packages are exported with the batch dynamic (Ranker 1..256, MLP 1..1024).", ""]
    variants = list(LABELS)
    head = ["model", "batch"] + [LABELS[v] for v in variants]
    body = []
    for r in data["calls"]:
        cells = []
        for v in variants:
            t = r["us"].get(v)
            cells.append("n/a" if t is None else
                         f"{t:.1f}" + ("" if v == "package" else f" ({r['ratios'][v]:.2f}x)"))
        body.append([r["model"], r["batch"], *cells])
    lines += [common.md_table(head, body), ""]
    for r in data["calls"]:
        floor = r["us"].get("read_floor")
        if floor is None:
            continue
        gap = r["us"]["kwker_eager"] - r["us"]["package"]
        over = r["overhead"]["over_us"]
        lines += [f"{r['model']} b{r['batch']} reads each of its weights once: the read probe "
                  f"takes {floor:.1f} us for as many bytes, so the package runs at "
                  f"{floor / r['us']['package']:.0%} of that floor. torch.compile's path costs "
                  f"{gap:.1f} us more per call than the package's; with kernels at the floor "
                  f"the best ratio would be {(floor + gap + over) / (floor + over):.2f}x.", ""]
    lines += ["Cost of a package call over its kernels, timed directly: the package with each "
              "kernel step replaced by one storing the kernel's answer, so the rest of a call "
              "(input checks, autograd switch, slots, ATen steps, output structure) is what "
              "runs:", ""]
    lines += [common.md_table(["model", "batch", "call us", "cost over the kernels us"],
                              [[r["model"], r["batch"], f"{r['overhead']['call_us']:.1f}",
                                f"{r['overhead']['over_us']:.2f}"] for r in data["calls"]]), ""]
    s = data["startup"]
    lines += ["Fresh process, empty kernel cache, the Ranker package "
              f"({s['package_mb']:.1f} MB, code for this CPU inside): `import torch` "
              f"{s['import_torch']:.3f} s (not counted); `import kwker` + `load_package` + first "
              f"call {s['total']:.3f} s (load {s['load']:.3f}, first call "
              f"{s['first_call'] * 1e3:.1f} ms); dynamo imported: {s['dynamo']}; LLVM compiles: "
              f"{s['compiles']}; objects from the package: {s['packaged']}.", "",
              "## Targets", ""]
    lines += [common.md_table(["what", "target", "measured", "met"],
                              [[t["what"], t["target"], t["measured"], "yes" if t["met"] else
                                "**no**"] for t in data["targets"]]), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no files")
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    common.set_threads()
    info = common.machine_info()
    t0 = time.perf_counter()
    rows = calls(5 if args.quick else 20, args.quick)
    start = startup(1 if args.quick else 3)
    data = {"benchmark": "package", "script": "bench_package.py", "machine": info,
            "calls": rows, "startup": start, "seconds": time.perf_counter() - t0}
    data["targets"] = targets(rows, start)
    data["headline"] = headline(rows, start)
    for t in data["targets"]:
        print(f"{'met' if t['met'] else 'NOT met'}: {t['what']}: {t['measured']} "
              f"(target {t['target']})")
    out = args.out or (None if args.quick else common.RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "package.md").write_text(markdown(data))
        common.write_json(out / "package.json", data)
        print(f"wrote {out / 'package.md'}, package.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
