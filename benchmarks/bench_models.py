"""Whole models under PyTorch eager, Inductor, the Kwker backend and the peers a user could pick.

Speed: every variant of a model is compiled in this process, checked against eager (a speed-up
of a wrong answer is reported as such), then timed interleaved, best of N after warm-up, on 2
threads. The peers, ONNX Runtime and OpenVINO, run side by side in the same rounds when they are
installed (``pip install -e ".[bench]"``), else their columns say so. For the tutorial model the
per-call cost of Kwker's compiled graph beyond its kernels is split into Kwker's own share and
dynamo's (which every ``torch.compile`` backend pays). First-compile time: ``torch.compile`` +
first call in a fresh process, once with empty Kwker and Inductor caches ("cold") and once more
with the caches that run left ("warm"); importing torch and torch._dynamo is timed separately,
since every backend pays it.

    python benchmarks/bench_models.py            # writes results/models.{md,json,png}
    python benchmarks/bench_models.py --quick    # fewer reps, prints only
    python benchmarks/bench_models.py --compile-times all   # cold/warm compile of every model
    python benchmarks/bench_models.py --sections bf16 avx2  # only the bf16 sections
    python benchmarks/bench_models.py --isa avx2 --quick    # the AVX2 rows alone (prints JSON)

Compile times are measured for the tutorial model unless ``--compile-times all`` (each costs two
fresh processes per compiler, minutes for all models with cold Inductor caches).

Sections (``--sections``, default all): ``f32`` (the above), ``bf16`` (models_bf16.py: each
model as ``.to(bfloat16)`` and under CPU autocast, against eager bf16, Inductor and OpenVINO bf16,
with an accuracy contract against the float32 model) and ``avx2`` (the bf16 rows without
AVX512_BF16, in a child process; see isa_env.py). Running a subset updates only those sections of
the results files.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # before torch is imported: --isa avx2 needs its environment first
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import isa_env
    isa_env.ensure(sys.argv)

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import isa_env
import models_bf16
from model_defs import MODELS, TUTORIAL, Attention, Ranker, build  # noqa: F401 - re-exported
from models_overhead import (OVERHEAD_METHOD, OVERHEAD_ROWS,  # noqa: F401 - re-exported
                             OVERHEAD_TARGET_US, overhead, overhead_table)
from peers import (NOT_INSTALLED, PEER_BUILDERS, PEER_MODULES, PEERS, SETTLE,  # noqa: F401
                   _quiet, export_onnx, onnxruntime_call, openvino_call, peer_missing)

VARIANTS = ("eager", "inductor", "kwker_eager", "kwker", "kwker_package")
LABELS = {"eager": "PyTorch eager", "inductor": "Inductor", "kwker_eager": "Kwker inner=eager",
          "kwker": "Kwker (default)", "kwker_package": "Kwker package",
          "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}
_PACKAGES = tempfile.TemporaryDirectory(prefix="kwker-bench-pkg-")
BUDGET_MIN = 15   # minutes a full run may take on any CPU (issue 18)


def compile_variant(model, variant: str, inputs=None):
    """``model`` as ``variant`` runs it; ``kwker_package``: exported at ``inputs``' sizes,
    packaged (kwker.package) and loaded back (kwker.load_package)."""
    if variant == "eager":
        return model
    if variant == "kwker_package":
        import kwker
        ep = torch.export.export(model, tuple(inputs))
        path = Path(_PACKAGES.name) / f"model{len(os.listdir(_PACKAGES.name))}.kwk"
        return kwker.load_package(kwker.package(ep, path))
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
    compiled = compile_variant(model, variant, inputs)
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


_timed = common.best_of_rounds


def speed(name: str, reps: int, rounds: int, peers=PEERS, models=None,
          variants=VARIANTS) -> dict:
    """One row: ``name`` (from ``models``, ``MODELS`` by default) as each of ``variants`` and
    each peer, checked against eager, then timed interleaved; the seconds each variant's
    compile and first call took, and what each Kwker compile lowered (models_bf16.lowering)."""
    import kwker.dynamo as kd
    model, inputs = build(name, models)
    row = {"model": name, "ms": {}, "check": {}, "kernels": "", "peers": {}, "compile_s": {},
           "lowering": {}}
    sides = []
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        expected = model(*inputs)
        calls = {}
        path = os.path.join(tmp, "model.onnx")
        onnx_file = functools.cache(lambda: (path, export_onnx(model, inputs, path)))
        for peer in PEERS:  # before dynamo compiles anything, so exporting sees a clean state
            t0 = time.perf_counter()
            why = peer_missing(peer) if peer in peers else "not run (--no-peers)"
            if why is None:
                try:
                    calls[peer], how = PEER_BUILDERS[peer](model, inputs, onnx_file)
                    row["check"][peer] = check(name, expected, calls[peer]())
                    row["peers"][peer] = {"how": how, "setup_s": time.perf_counter() - t0}
                except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                    calls.pop(peer, None)
                    why = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
            if why is not None:
                row["peers"][peer] = {"skipped": why}
        for variant in variants:
            torch._dynamo.reset()
            kd.clear_reports()
            t0 = time.perf_counter()
            fn = compile_variant(model, variant, inputs)
            got = fn(*inputs)
            row["compile_s"][variant] = time.perf_counter() - t0
            row["check"][variant] = "ok" if variant == "eager" else check(name, expected, got)
            if variant in ("kwker_eager", "kwker"):
                row["lowering"][variant] = models_bf16.lowering(kd.all_reports())
            if variant == "kwker_eager":
                row["kernels"] = ", ".join(kd.last_report().kernel_names)
            sides.append(common.Side(variant, lambda fn=fn: fn(*inputs), torch.no_grad))
        sides += [common.Side(p, fn, torch.no_grad, pool=p) for p, fn in calls.items()]
        # the peers' thread pools are not torch's: let each side's spinning threads go idle
        # before the next side's sample (see common._sample)
        settle = SETTLE if calls else 0.0
        for side, t in zip(sides, _timed(sides, reps, rounds, settle)):
            row["ms"][side.name] = t * 1e3
    return row


# ------------------------------------------------------------------------------ output
def _s(v):
    return "—" if v is None else f"{v:.1f}"


def _ratio(ms: dict, base: str, v: str):
    """ms[base] / ms[v] (> 1: ``v`` is faster), None when either was not timed."""
    return ms[base] / ms[v] if ms.get(base) and ms.get(v) else None


def _x(r) -> str:
    return "—" if r is None else f"{r:.2f}x"


def table(rows, markdown=True):
    headers = ["model", *(LABELS[v] + " ms" for v in VARIANTS), "eager / Kwker inner=eager",
               "eager / Kwker", "compile s (cold / warm): Inductor", "Kwker inner=eager",
               "Kwker", "check"]
    body = []
    for r in rows:
        ms = r["ms"]
        ct = r.get("compile", {})
        bad = [f"{v}: {c}" for v, c in r["check"].items() if v in VARIANTS and c != "ok"]
        body.append([r["model"], *(common.fmt_ms(ms[v] / 1e3) if v in ms else "—"
                                   for v in VARIANTS),
                     _x(_ratio(ms, "eager", "kwker_eager")), _x(_ratio(ms, "eager", "kwker")),
                     *(f"{_s(ct.get(v, {}).get('cold'))} / {_s(ct.get(v, {}).get('warm'))}"
                       if v in ct else "—" for v in ("inductor", "kwker_eager", "kwker")),
                     "; ".join(bad) or "ok"])
    return (common.md_table if markdown else common.text_table)(headers, body)


def peer_table(rows, markdown=True):
    """Kwker against ONNX Runtime and OpenVINO: peer ms / Kwker ms, > 1 means Kwker is faster."""
    kw = ("kwker_eager", "kwker", "kwker_package")
    headers = ["model", *(LABELS[v] + " ms" for v in (*kw, *PEERS)),
               *(f"{LABELS[k]} vs {LABELS[p]}" for p in PEERS for k in kw),
               "setup s: " + " / ".join(LABELS[p] for p in PEERS), "check"]

    def peer_ms(r, p):
        ms, skipped = r["ms"], r.get("peers", {}).get(p, {}).get("skipped", "not run")
        if ms.get(p):
            return common.fmt_ms(ms[p] / 1e3)
        if skipped.startswith("not installed"):
            return NOT_INSTALLED
        return "failed (below)" if skipped.startswith("failed") else skipped

    body = []
    for r in rows:
        ms, info = r["ms"], r.get("peers", {})
        bad = [f"{LABELS[p]}: {c}" for p, c in r["check"].items() if p in PEERS and c != "ok"]
        body.append([r["model"], *(common.fmt_ms(ms[k] / 1e3) if k in ms else "—" for k in kw),
                     *(peer_ms(r, p) for p in PEERS),
                     *(_x(_ratio(ms, p, k)) for p in PEERS for k in kw),
                     " / ".join(_s(info.get(p, {}).get("setup_s")) for p in PEERS),
                     "; ".join(bad) or "ok"])
    return (common.md_table if markdown else common.text_table)(headers, body)


def peer_notes(rows) -> list[str]:
    """How each peer ran each model (exporter, conversion path), and why any was skipped."""
    out = []
    for p in PEERS:
        hows = {}
        for r in rows:
            i = r.get("peers", {}).get(p, {})
            hows.setdefault(i.get("how") or i.get("skipped") or "not run", []).append(r["model"])
        for how, models in hows.items():
            which = "all models" if len(models) == len(rows) else ", ".join(models)
            out.append(f"- {LABELS[p]}: {how} ({which})")
    return out


PEER_METHOD = (
    "Timed in the same interleaved rounds as the variants above, from torch tensors to torch "
    "tensors (`Tensor.numpy()` in, `torch.from_numpy` out: zero-copy). ONNX Runtime: the "
    "model exported to ONNX, `InferenceSession` on the CPU execution provider with "
    "`intra_op_num_threads` = torch's threads, `ORT_ENABLE_ALL`, sequential execution. "
    "OpenVINO: `openvino.convert_model`, compiled for `CPU` with `INFERENCE_NUM_THREADS` = "
    "torch's threads, `PERFORMANCE_HINT=LATENCY` and `INFERENCE_PRECISION_HINT=f32`: its "
    "default on CPUs with AVX-512 BF16 is bf16, which misses eager's results by ~1e-3. "
    "Outputs checked against eager like Kwker's. Ratio = peer time / Kwker time (> 1 "
    "means Kwker is faster); setup = export or conversion + session, in this process. "
    f"When peers run, every sample (of every variant) starts after a {SETTLE * 1e3:g} ms "
    "pause and one untimed call: ONNX Runtime's idle workers spin ~30 ms after a call and "
    "torch's OpenMP workers a few ms, which on 2 cores would slow whichever side runs "
    "next.")
def markdown(rows, info, reps, over=None, rounds=3, bf16: dict | None = None) -> str:
    dyn = [r["compile"][v]["dynamo_import_s"] for r in rows for v in r.get("compile", {})
           if r["compile"][v].get("dynamo_import_s")]
    lines = [
        "# Models: PyTorch eager, Inductor, Kwker and its peers", "",
        f"`python benchmarks/bench_models.py` — {common.machine_line(info)}, "
        + f"{common.load()} at end.", "",
        f"Best of {rounds} rounds of {reps} interleaved samples after warm-up, `torch.no_grad()`, "
        "float32. Ratios "
        "are eager time / Kwker time from the same run (> 1 means Kwker is faster). Compile "
        "time is `torch.compile` + the first call in a fresh process: *cold* with empty Kwker "
        "and Inductor caches, *warm* in a second process reusing them. "
        + (f"Importing `torch._dynamo` (paid by every backend, not included) took "
           f"{min(dyn):.1f}–{max(dyn):.1f} s." if dyn else ""), "",
        table(rows), "", *common.runs_note(rows, info),
        ("Plot: [models.png](models.png) (eager time / each variant's time per model; the "
         "black tick is the fastest peer, which Kwker must beat)."), "",
        "## Peers: ONNX Runtime and OpenVINO", "",
        PEER_METHOD, "",
        peer_table(rows), "", *peer_notes(rows), "",
    ]
    if over:
        title = f"## Per-call overhead of the compiled graph ({over['model']}, Kwker inner=eager)"
        lines += [title, "",
                  OVERHEAD_METHOD, "",
                  overhead_table(over), ""]
    lines += ["Kernels chosen by Kwker (inner=eager) per model:", "",
              *[f"- {r['model']}: {r['kernels'] or 'none'}" for r in rows], ""]
    if bf16:
        lines += [models_bf16.markdown(bf16)]
    return "\n".join(lines)


def headline(rows, over=None) -> list[dict]:
    """The index's few figures: the tutorial model, the means, the worst cases, vs the peers."""
    out = []

    def add(label, ratio, target=1.0):
        if ratio is not None:
            out.append({"label": label, "ratio": ratio, "target": target})
    tut = next((r for r in rows if r["model"] == TUTORIAL), None)
    if tut:
        add(f"{TUTORIAL} Kwker inner=eager vs eager", _ratio(tut["ms"], "eager", "kwker_eager"))
        for p in PEERS:
            add(f"{TUTORIAL} Kwker inner=eager vs {LABELS[p]}", _ratio(tut["ms"], p, "kwker_eager"))
    for v in ("kwker_eager", "kwker"):
        rs = [x for x in (_ratio(r["ms"], "eager", v) for r in rows) if x]
        if rs:
            add(f"{LABELS[v]} vs eager, geomean of {len(rs)} models",
                math.exp(sum(map(math.log, rs)) / len(rs)))
    worst = [(_ratio(r["ms"], "eager", v), f"{r['model']} {LABELS[v]}") for r in rows
             for v in ("kwker_eager", "kwker") if _ratio(r["ms"], "eager", v)]
    if worst:
        ratio, label = min(worst)
        add(f"lowest vs eager: {label}", ratio)
    vs_peer = []
    for r in rows:
        peer = min((p for p in PEERS if r["ms"].get(p)), key=lambda p: r["ms"][p], default=None)
        if peer:
            k = min(("kwker_eager", "kwker"), key=lambda v: r["ms"][v])
            vs_peer.append((_ratio(r["ms"], peer, k),
                            f"{r['model']} {LABELS[k]} vs {LABELS[peer]}"))
    if vs_peer:
        ratio, label = min(vs_peer)
        add(f"lowest vs the fastest peer: {label}", ratio)
    return out


PLOT_SERIES = ("inductor", "kwker_eager", "kwker", "onnxruntime", "openvino")
COLORS = {"inductor": "tab:gray", "kwker_eager": "tab:green", "kwker": "tab:olive",
          "onnxruntime": "tab:blue", "openvino": "tab:purple"}


def plot(rows, path: Path, info: dict) -> bool:
    """Per model, eager time / each variant's time (log); a black tick at the fastest peer."""
    plt = common.pyplot()
    if plt is None:
        return False
    series = [v for v in PLOT_SERIES if any(r["ms"].get(v) for r in rows)]
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.16 * len(series) * len(rows)))
    h, seen = 0.8 / max(1, len(series)), set()
    for i, r in enumerate(rows):
        y0 = len(rows) - 1 - i
        for j, v in enumerate(series):
            ratio = _ratio(r["ms"], "eager", v)
            if ratio is None:
                continue
            wrong = r["check"].get(v, "ok") != "ok"
            y = y0 + 0.4 - (j + 0.5) * h
            ax.barh(y, ratio, height=h, color=COLORS[v], hatch="//" if wrong else None,
                    label=None if v in seen else LABELS[v])
            ax.text(ratio * 1.02, y, f"{ratio:.2f}x", va="center", fontsize=6)
            seen.add(v)
        peers = [x for x in (_ratio(r["ms"], "eager", p) for p in PEERS) if x]
        if peers:
            ax.plot([max(peers)] * 2, [y0 - 0.45, y0 + 0.45], color="black", lw=2)
    ax.axvline(1.0, color="grey", lw=0.8)
    common.log_x(ax)
    ax.set_yticks(range(len(rows)), [r["model"] for r in rows][::-1], fontsize=8)
    ax.set_xlabel("eager ms / variant ms (log, higher is faster; grey line = eager, black tick "
                  "= fastest peer; hatched = wrong result)", fontsize=8)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return common.save_plot(fig, path, f"Models vs PyTorch eager; {common.machine_line(info)}")


SECTIONS = ("f32", "bf16", "avx2")


def _merged(old: list, new: list, subset, info: dict) -> list:
    """``new`` rows, and with a ``--models`` subset also the old rows of the other models (in
    their old places), so a partial run updates its rows and keeps the rest. Each row records
    when and at which commit it was measured (``run``): a table of merged rows says so."""
    for r in new:
        r["run"] = f"{info['date']}, kwker {info.get('commit', '?')}"
    if not subset:
        return new
    key = lambda r: (r.get("model"), r.get("mode"))  # noqa: E731
    fresh = {key(r): r for r in new}
    rows = [fresh.pop(key(r), r) for r in old]
    return rows + list(fresh.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no results files")
    ap.add_argument("--compile-times", choices=("tutorial", "all", "none"), default="tutorial")
    ap.add_argument("--models", nargs="*", help="subset of model names (of any section)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="f32: float32 models; bf16: bf16 and autocast models; avx2: bf16 "
                         "without AVX512_BF16 (child process)")
    ap.add_argument("--no-peers", action="store_true", help="skip ONNX Runtime and OpenVINO")
    ap.add_argument("--max-autotune", action="store_true",
                    help="bf16 section: also Inductor with freezing and max-autotune (CPP and "
                    "ATen GEMMs), the best PyTorch peer; minutes of autotuning per model")
    ap.add_argument("--isa", choices=tuple(isa_env.ISA_ENVS),
                    help="run only the bf16 rows of this ISA in this process and print them "
                         "as JSON (re-executes with its environment)")
    ap.add_argument("--probe", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.probe:
        probe(*args.probe)
        return 0
    common.set_threads()
    info = common.machine_info()
    reps = 5 if args.quick else 20
    rounds = 1 if args.quick else 3
    bf16_all = list(models_bf16.BF16_MODELS)
    unknown = [n for n in args.models or () if n not in MODELS and n not in bf16_all]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {list(MODELS)} (float32) or "
                 f"{bf16_all} (bf16)")
    if args.isa:
        models_bf16.avx2_child(args.models or bf16_all, reps, rounds)
        return 0
    sections = set(args.sections)
    names = [n for n in args.models or MODELS if n in MODELS]
    bf16_names = [n for n in args.models or bf16_all if n in bf16_all]
    peer_list = () if args.no_peers else PEERS
    out = args.out or (None if args.quick else common.RESULTS)
    old = {}
    if out is not None and (sections != set(SECTIONS) or args.models):
        # keep the sections, and the rows of the models, not run this time
        with contextlib.suppress(OSError, ValueError):
            old = json.loads((out / "models.json").read_text())
    data = {"benchmark": "models", "script": "bench_models.py", "machine": info, "reps": reps,
            "rounds": rounds, "rows": [], "overhead": None,
            **{k: v for k, v in old.items() if k != "headline"}}
    seconds = data.setdefault("seconds", {})   # each section's last run, for the time budget
    clock = time.perf_counter()
    if "f32" in sections:
        data.update(machine=info, reps=reps, rounds=rounds, rows=_merged(
            data["rows"], run_f32(names, reps, rounds, peer_list, args.compile_times),
            args.models, info))
        data["overhead"] = over = (overhead(TUTORIAL, reps, rounds) if TUTORIAL in names
                                   else data.get("overhead") if args.models else None)
        print_f32(data["rows"], over)
        seconds["f32"], clock = time.perf_counter() - clock, time.perf_counter()
    bf16 = data.setdefault("bf16", {}) if sections & {"bf16", "avx2"} else data.get("bf16")
    if "bf16" in sections:
        bf16.update(machine=info, reps=reps, rounds=rounds, rows=_merged(
            bf16.get("rows", []), models_bf16.run(bf16_names, reps, rounds, peer_list,
                                                  max_autotune=args.max_autotune),
            args.models, info))
        seconds["bf16"], clock = time.perf_counter() - clock, time.perf_counter()
    if "avx2" in sections:
        fresh = models_bf16.run_avx2(bf16_names, args.quick, Path(__file__))
        if not fresh.get("error"):
            fresh["rows"] = _merged((bf16.get("avx2") or {}).get("rows", []), fresh["rows"],
                                    args.models, info)
        bf16["avx2"] = fresh
        seconds["avx2"] = time.perf_counter() - clock
    total = sum(seconds.values())
    print(f"\nsections took {', '.join(f'{k} {v / 60:.1f}' for k, v in seconds.items())} min "
          f"(a full run: {total / 60:.1f} min; issue 18 asks for under {BUDGET_MIN} on any CPU)")
    if bf16:
        for text in (models_bf16.speed_table, models_bf16.accuracy_table):
            print()
            print(text(bf16.get("rows", []), markdown=False))
        print("\n".join(models_bf16.notes(bf16.get("rows", []))))
        if bf16.get("avx2") is not None:
            print()
            print(models_bf16.avx2_table(bf16["avx2"], markdown=False))
    data["headline"] = headline(data["rows"], data["overhead"]) + models_bf16.headline(
        bf16 or {})
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "models.md").write_text(markdown(data["rows"], data["machine"], data["reps"],
                                                data["overhead"], data["rounds"], bf16))
        common.write_json(out / "models.json", data)
        if data["rows"]:
            plot(data["rows"], out / "models.png", data["machine"])
        if bf16:
            models_bf16.plot(bf16, out / "models_bf16.png", bf16.get("machine", info))
        print(f"wrote {out / 'models.md'}, models.json, models.png, models_bf16.png")
    wrong = [r["model"] for r in data["rows"] if "f32" in sections
             and any(c != "ok" for v, c in r["check"].items() if v in VARIANTS)]
    bad = models_bf16.broken(bf16.get("rows", []) if "bf16" in sections else [],
                             bf16.get("avx2") if "avx2" in sections else None) if bf16 else []
    for b in bad:
        print(f"ACCURACY CONTRACT BROKEN (bug): {b}", file=sys.stderr)
    return 1 if wrong or bad else 0


def run_f32(names, reps, rounds, peer_list, which: str) -> list[dict]:
    """The float32 rows; compile times for ``which`` models ("tutorial", "all", "none")."""
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = speed(name, reps, rounds, peer_list)
        if which == "all" or (which == "tutorial" and name == TUTORIAL):
            row["compile"] = {v: compile_times(name, v) for v in ("inductor", "kwker_eager",
                                                                  "kwker")}
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(table([row], markdown=False).splitlines()[-1], flush=True)
    return rows


def print_f32(rows, over) -> None:
    print()
    print(table(rows, markdown=False))
    print()
    print(peer_table(rows, markdown=False))
    print("\n".join(peer_notes(rows)))
    if over:
        print()
        print(overhead_table(over, markdown=False))


if __name__ == "__main__":
    sys.exit(main())
