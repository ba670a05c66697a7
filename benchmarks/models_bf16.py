"""The bfloat16 section of bench_models.py: models in bf16 under eager, Inductor, both Kwker modes
and OpenVINO bf16, each model both as ``.to(torch.bfloat16)`` and as the float32 model called
inside ``torch.autocast("cpu", dtype=torch.bfloat16)``; then the same without AVX512_BF16 (the
AVX2 path, in a child process whose environment holds ATen, oneDNN and Kwker to AVX2).

Every row also records the accuracy contract (max abs error against the float32 model: Kwker's
<= 1.25 x eager bf16's + 1e-3 x max|reference|) and how many Kwker kernels were built, from the
backend's reports, so a silent fallback to the inner compiler shows as 0 kernels.
"""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import common
import isa_env
import peers
import torch
from model_defs import AVX2_MODELS, BF16_MODELS, BF16_TARGETS_AMX, Missing, build

MODES = ("bf16", "autocast")
MODE_LABELS = {"bf16": ".to(bfloat16)", "autocast": "autocast(bf16)"}
VARIANTS = ("eager", "inductor", "kwker_eager", "kwker")
KWKER = ("kwker_eager", "kwker")
# the best PyTorch peer, on request (--max-autotune): common.MAX_AUTOTUNE_OPTIONS
MAX_AUTOTUNE = "inductor_max"
LABELS = {"eager": "eager bf16", "inductor": "Inductor bf16", "kwker_eager": "Kwker inner=eager",
          "kwker": "Kwker (default)", "openvino": "OpenVINO bf16", "onnxruntime": "ONNX Runtime",
          MAX_AUTOTUNE: "Inductor max-autotune bf16"}
ERR_FACTOR, ERR_ABS = 1.25, 1e-3  # the contract: err <= 1.25 x eager's + 1e-3 x max|ref|
AVX2_TAG = "AVX2_ROWS "           # the child's result line on stdout


# ------------------------------------------------------------------------------- running
def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _err(out, ref: torch.Tensor) -> float:
    return (_first(out).detach().double() - ref.double()).abs().max().item()


def _bf16(t):
    return t.to(torch.bfloat16) if t.is_floating_point() else t


def setup(model, inputs, mode: str):
    """(model, inputs, context factory) of ``mode``: the model and its float inputs cast to
    bf16, or the float32 ones called inside CPU autocast to bf16; both under no_grad."""
    if mode == "bf16":
        return copy.deepcopy(model).to(torch.bfloat16), tuple(map(_bf16, inputs)), torch.no_grad
    autocast = common.contexts(torch.no_grad,
                               lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    return model, inputs, autocast


def compile_variant(model, variant: str):
    if variant == "eager":
        return model
    if variant == "inductor":
        return torch.compile(model)
    if variant == MAX_AUTOTUNE:
        return torch.compile(model, options=common.MAX_AUTOTUNE_OPTIONS)
    return torch.compile(model, backend="kwker",
                         options={"inner": "eager"} if variant == "kwker_eager" else None)


def lowering(reports) -> dict:
    """What the backend's reports of one compile say: kernels (all, bf16), graphs, fallbacks."""
    kinds = Counter(f"{k[0]} {k[2]}" for r in reports for k in r.kernels)
    return {"kernels": sum(kinds.values()),
            "bf16": sum(n for k, n in kinds.items() if k.endswith("bfloat16")),
            "graphs": len(reports),
            "inner_nodes": sum(len(r.inner_nodes) for r in reports),
            "missed": [f"{n} ({op}): {why}" for r in reports for n, op, why in r.missed],
            "fallback": [f"graph {r.graph}: {r.status} ({r.reason})" for r in reports
                         if r.status != "lowered"],
            "names": ", ".join(f"{k} x{n}" if n > 1 else k for k, n in kinds.items())}


def _peer_setup(row, model, inputs, run_model, run_inputs, mode, peer_list, tmp) -> dict:
    """Build the peers of one row (before dynamo compiles anything); their calls by name."""
    calls = {}
    ov = peers.peer_missing("openvino") if "openvino" in peer_list else "not run (--no-peers)"
    if ov is None:
        t0 = time.perf_counter()
        try:
            calls["openvino"], how = peers.openvino_call(
                model, inputs, lambda: (_export(model, inputs, tmp)), "bf16", feed=run_inputs)
            row["peers"]["openvino"] = {"how": how, "setup_s": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
            ov = f"failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
    if ov is not None:
        row["peers"]["openvino"] = {"skipped": ov}
    ort = peers.peer_missing("onnxruntime") if "onnxruntime" in peer_list else \
        "not run (--no-peers)"
    if ort is None:
        ort = ("not run: ONNX has no autocast; see the .to(bfloat16) row" if mode == "autocast"
               else peers.onnxruntime_bf16(run_model, run_inputs, os.path.join(tmp, "bf16.onnx")))
    row["peers"]["onnxruntime"] = {"skipped": ort}
    return calls


def _export(model, inputs, tmp):
    path = os.path.join(tmp, "model.onnx")
    return path, peers.export_onnx(model, inputs, path)


def speed(name: str, mode: str, reps: int, rounds: int, variants=VARIANTS,
          peer_list=peers.PEERS, models=None, amx_targets=None) -> dict:
    """One row: ``name`` in ``mode``, every variant checked against the float32 model and
    timed interleaved with the peers. ``models``: name -> (builder, target, must beat
    OpenVINO), ``BF16_MODELS`` by default; ``amx_targets`` replace those on a CPU with AMX."""
    import kwker.dynamo as kd

    models = BF16_MODELS if models is None else models
    amx_targets = BF16_TARGETS_AMX if amx_targets is None else amx_targets
    _, target, beat_ov = models[name]
    from kwker.runtime.target import host_target
    if host_target().tiles == "amx":
        target, beat_ov = amx_targets.get(name, (target, beat_ov))
    row = {"model": name, "mode": mode, "target": target, "beat_openvino": beat_ov, "ms": {},
           "err": {}, "lowering": {}, "peers": {}}
    try:
        model, inputs = build(name, {k: v[0] for k, v in models.items()})
    except Missing as e:
        return {**row, "skipped": str(e)}
    with torch.no_grad():
        ref = _first(model(*inputs)).float()
    row["ref_max"] = ref.abs().max().item()
    run_model, run_inputs, ctx = setup(model, inputs, mode)
    with tempfile.TemporaryDirectory() as tmp:
        torch._dynamo.reset()
        calls = _peer_setup(row, model, inputs, run_model, run_inputs, mode, peer_list, tmp)
        sides = []
        for variant in variants:
            torch._dynamo.reset()
            kd.clear_reports()
            fn = compile_variant(run_model, variant)
            try:
                with ctx():
                    row["err"][variant] = _err(fn(*run_inputs), ref)
            except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
                row.setdefault("failed", {})[variant] = \
                    f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}"
                continue
            finally:
                if variant in KWKER:
                    row["lowering"][variant] = lowering(kd.all_reports())
            sides.append(common.Side(variant, lambda fn=fn: fn(*run_inputs), ctx))
        for p, fn in calls.items():
            row["err"][p] = _err(fn(), ref)
            sides.append(common.Side(p, fn, torch.no_grad, pool=p))
        settle = peers.SETTLE if calls else 0.0
        for side, t in zip(sides, common.best_of_rounds(sides, reps, rounds, settle)):
            row["ms"][side.name] = t * 1e3
    if "eager" not in row["err"]:
        return row
    row["bound"] = ERR_FACTOR * row["err"]["eager"] + ERR_ABS * row["ref_max"]
    row["contract"] = {v: "ok" if row["err"][v] <= row["bound"] else "BROKEN"
                       for v in KWKER if v in row["err"]}
    row["contract"].update({v: "FAILED" for v in row.get("failed", {}) if v in KWKER})
    return row


def run(names, reps: int, rounds: int, peer_list=peers.PEERS, log=print,
        max_autotune: bool = False, models=None, amx_targets=None) -> list[dict]:
    """Every model of ``names`` in both modes (``speed``; ``models``/``amx_targets`` as there)."""
    rows = []
    variants = VARIANTS + ((MAX_AUTOTUNE,) if max_autotune else ())
    for name in names:
        for mode in MODES:
            t0 = time.perf_counter()
            rows.append(speed(name, mode, reps, rounds, variants=variants, peer_list=peer_list,
                              models=models, amx_targets=amx_targets))
            rows[-1]["seconds"] = time.perf_counter() - t0
            log(speed_table(rows[-1:], markdown=False).splitlines()[-1], flush=True)
    return rows


# ------------------------------------------------------------------- without AVX512_BF16
def avx2_child(names, reps: int, rounds: int) -> None:
    """In the ``--isa avx2`` process: eager bf16 vs Kwker inner=eager, one JSON line out."""
    from kwker.runtime.target import host_target

    t = host_target()
    env = {k: os.environ.get(k) for k in isa_env.AVX2_ENV}
    rows = [speed(n, m, reps, rounds, variants=("eager", "kwker_eager"), peer_list=())
            for n in names if n in AVX2_MODELS for m in MODES]
    print(AVX2_TAG + json.dumps({
        "env": env, "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "kwker_target": t.describe(), "avx512bf16": t.has("avx512bf16"), "rows": rows}))


def run_avx2(names, quick: bool, script: Path, log=print) -> dict:
    """Re-invoke ``script --isa avx2`` for the AVX2 rows; its JSON, or {"error": why}."""
    names = [n for n in names if n in AVX2_MODELS]
    if not names:
        return {"rows": [], "error": "no AVX2 model selected"}
    cmd = [sys.executable, str(script), "--isa", "avx2", "--models", *names,
           *(["--quick"] if quick else [])]
    log(f"AVX2 rows in a child process: {' '.join(f'{k}={v}' for k, v in isa_env.AVX2_ENV.items())}"
        f" {' '.join(cmd[1:3])} ...", flush=True)
    res = subprocess.run(cmd, capture_output=True, text=True, check=False,
                         env={**os.environ, **isa_env.AVX2_ENV})
    line = next((x for x in reversed(res.stdout.splitlines()) if x.startswith(AVX2_TAG)), None)
    if res.returncode != 0 or line is None:
        tail = (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
        return {"rows": [], "error": f"child failed (exit {res.returncode}): {tail[:300]}"}
    return json.loads(line[len(AVX2_TAG):])


# ------------------------------------------------------------------------------- output
def _ms(r, v):
    if v in r.get("failed", {}):
        return "failed (below)"
    return common.fmt_ms(r["ms"][v] / 1e3) if r.get("ms", {}).get(v) else "—"


def ratio(r, base: str, v: str):
    ms = r.get("ms", {})
    return ms[base] / ms[v] if ms.get(base) and ms.get(v) else None


def _x(x) -> str:
    return "—" if x is None else f"{x:.2f}x"


def best_kwker(r) -> str | None:
    timed = [v for v in KWKER if r.get("ms", {}).get(v)]
    return min(timed, key=lambda v: r["ms"][v]) if timed else None


def target_mark(r) -> str:
    """The row's target on its faster Kwker variant: ratio vs eager bf16, or vs OpenVINO."""
    k = best_kwker(r)
    marks = []
    if r.get("target") and k:
        got = ratio(r, "eager", k)
        marks.append(f"{r['target']:g}x " + ("ok" if got >= r["target"] else "BELOW"))
    if k and r.get("ms", {}).get(MAX_AUTOTUNE):
        marks.append("vs Inductor max-autotune: " + ("ahead" if ratio(r, MAX_AUTOTUNE, k) > 1
                                                     else "BEHIND"))
    if r.get("beat_openvino") and k:
        vs = ratio(r, "openvino", k)
        marks.append("vs OpenVINO: " + ("not timed" if vs is None else
                                        "ahead" if vs > 1 else "BEHIND"))
    return "; ".join(marks)


def _skip(r, n):
    return [r["model"], MODE_LABELS[r["mode"]], f"skipped: {r['skipped']}", *[""] * (n - 3)]


def speed_table(rows, markdown=True) -> str:
    peer_cols = [p for p in (MAX_AUTOTUNE, "openvino")
                 if p == "openvino" or any(r.get("ms", {}).get(p) for r in rows)]
    headers = ["model", "mode", *(LABELS[v] + " ms" for v in (*VARIANTS, *peer_cols)),
               "eager / Kwker inner=eager", "eager / Kwker",
               *(f"{LABELS[p].replace(' bf16', '')} / best Kwker" for p in peer_cols),
               "target (best Kwker)"]
    body = []
    for r in rows:
        if "skipped" in r:
            body.append(_skip(r, len(headers)))
            continue
        k = best_kwker(r)
        body.append([r["model"], MODE_LABELS[r["mode"]],
                     *(_ms(r, v) for v in (*VARIANTS, *peer_cols)),
                     *(_x(ratio(r, "eager", v)) for v in KWKER),
                     *(_x(ratio(r, p, k) if k else None) for p in peer_cols), target_mark(r)])
    return (common.md_table if markdown else common.text_table)(headers, body)


def _e(r, v):
    e = r.get("err", {}).get(v)
    return "—" if e is None else f"{e:.2e}"


def _low(r, v):
    lo = r.get("lowering", {}).get(v)
    if not lo:
        return "—"
    fb = f", {len(lo['fallback'])} fell back" if lo["fallback"] else ""
    fb += f", {len(lo['missed'])} missed" if lo["missed"] else ""
    return f"{lo['kernels']} ({lo['bf16']} bf16) in {lo['graphs']} graph(s){fb}"


def accuracy_table(rows, markdown=True, variants=(*VARIANTS, "openvino")) -> str:
    headers = ["model", "mode", "max abs err vs float32: " + " / ".join(LABELS[v]
                                                                         for v in variants),
               "max abs ref", "bound", "contract " + " / ".join(LABELS[v] for v in KWKER
                                                               if v in variants),
               *(f"kernels {LABELS[v]}" for v in KWKER if v in variants)]
    body = []
    for r in rows:
        if "skipped" in r:
            body.append(_skip(r, len(headers)))
            continue
        body.append([r["model"], MODE_LABELS[r["mode"]], " / ".join(_e(r, v) for v in variants),
                     f"{r['ref_max']:.3g}", f"{r['bound']:.2e}" if "bound" in r else "—",
                     " / ".join(r.get("contract", {}).get(v, "—") for v in KWKER
                                if v in variants),
                     *(_low(r, v) for v in KWKER if v in variants)])
    return (common.md_table if markdown else common.text_table)(headers, body)


def avx2_table(avx2: dict, markdown=True) -> str:
    if avx2.get("error"):
        return f"AVX2 rows not run: {avx2['error']}"
    headers = ["model", "mode", "eager bf16 ms (ATen AVX2)", "Kwker inner=eager ms (AVX2)",
               "eager / Kwker", "max abs err eager / Kwker", "contract", "kernels"]
    body = [_skip(r, len(headers)) if "skipped" in r else
            [r["model"], MODE_LABELS[r["mode"]], _ms(r, "eager"), _ms(r, "kwker_eager"),
             _x(ratio(r, "eager", "kwker_eager")), f"{_e(r, 'eager')} / {_e(r, 'kwker_eager')}",
             r.get("contract", {}).get("kwker_eager", "—"), _low(r, "kwker_eager")]
            for r in avx2.get("rows", [])]
    return (common.md_table if markdown else common.text_table)(headers, body)


def broken(rows, avx2=None) -> list[str]:
    """Rows whose Kwker result breaks the accuracy contract (a bug, like a wrong result)."""
    every = [*rows, *((avx2 or {}).get("rows", []))]
    return [f"{r['model']} {MODE_LABELS[r['mode']]} {LABELS[v]}: " + (
        f"max abs err {r['err'][v]:.3g} > bound {r['bound']:.3g}" if c == "BROKEN"
        else f"failed: {r['failed'][v]}")
        for r in every for v, c in r.get("contract", {}).items() if c != "ok"]


def notes(rows) -> list[str]:
    """How the peers ran (or why not) and what each Kwker compile lowered."""
    out = []
    for p in ("openvino", "onnxruntime"):
        seen = {}
        for r in rows:
            i = r.get("peers", {}).get(p, {})
            how = i.get("how") or i.get("skipped") or "not run"
            seen.setdefault(how, []).append(f"{r['model']} {MODE_LABELS[r['mode']]}")
        out += [f"- {LABELS[p]}: {how} ({', '.join(which)})" for how, which in seen.items()]
    out += [f"- {LABELS[v]} failed on {r['model']} {MODE_LABELS[r['mode']]}: {why}"
            for r in rows for v, why in r.get("failed", {}).items()]
    out += [f"- {LABELS[v]} on {r['model']} {MODE_LABELS[r['mode']]}: its output equals the "
            "float32 reference bit for bit, so it ran in float32, not bf16"
            for r in rows for v, e in r.get("err", {}).items()
            if v != "eager" and e == 0.0 and r["err"].get("eager")]
    out += ["", "Kernels built by Kwker (inner=eager; the default mode's where it differs):", ""]
    for r in rows:
        lo = r.get("lowering", {})
        if not lo:
            continue
        a, b = lo.get("kwker_eager", {}), lo.get("kwker", {})
        text = a.get("names") or "none"
        if b and b.get("names") != a.get("names"):
            text += f"; default: {b.get('names') or 'none'}"
        for v, info in lo.items():
            text += "".join(f"; {LABELS[v]} {f}" for f in info["fallback"])
            if info["missed"]:  # "node (op): why", counted by "op: why"
                why = Counter(m.split(" (", 1)[-1].replace("): ", ": ", 1)
                              for m in info["missed"])
                text += f"; {LABELS[v]} missed {len(info['missed'])} node(s): " + "; ".join(
                    f"{n} x {w}" for w, n in why.items())
        out.append(f"- {r['model']} {MODE_LABELS[r['mode']]}: {text}")
    return out


METHOD = (
    "Each model is built in float32 from a fixed seed; the *reference* is that float32 model in "
    "eager. `.to(bfloat16)`: the model and its float inputs cast to bf16; `autocast(bf16)`: the "
    "float32 model called inside `torch.autocast(\"cpu\", dtype=torch.bfloat16)` (every side, "
    "compile and call). Ratios are eager bf16 time / variant time in the same interleaved "
    "rounds (best of N, `torch.no_grad()`). The target is held by the faster Kwker variant. "
    "OpenVINO bf16: `openvino.convert_model` of the float32 module compiled with "
    "`INFERENCE_PRECISION_HINT=bf16` (and the f32 section's threads and latency hint); it takes "
    "and returns float32, so a `.to(bfloat16)` row's inputs are converted inside its timed call. "
    "Accuracy contract: the max abs error of Kwker's output against the reference must be <= "
    f"{ERR_FACTOR:g} x eager bf16's + {ERR_ABS:g} x max|reference| (the `bound` column); "
    "BROKEN is a bug, like a wrong result. Kernels: from `kwker.dynamo.all_reports()` of each "
    "compile (0 means the graph silently ran on the inner compiler).")
AVX2_METHOD = (
    "The same rows on a CPU without AVX512_BF16, emulated in a child process (`bench_models.py "
    "--isa avx2`): `KWKER_CPU=znver3` (Kwker compiles for Zen 3: AVX2 + FMA, bf16 widened to "
    "float32 in registers), `ATEN_CPU_CAPABILITY=avx2` and `ONEDNN_MAX_CPU_ISA=AVX2` (eager's "
    "kernels held to AVX2), set before torch is imported.")


def markdown(bf16: dict) -> str:
    rows, avx2 = bf16.get("rows", []), bf16.get("avx2")
    info = bf16.get("machine")
    lines = ["## bfloat16: eager bf16, Inductor, Kwker, OpenVINO bf16", ""]
    if info:
        lines += [f"{common.machine_line(info)}; best of {bf16.get('rounds', '?')} rounds of "
                  f"{bf16.get('reps', '?')} samples.", ""]
    lines += [METHOD, "", "### Speed", "", speed_table(rows), "",
              *(common.runs_note(rows, info) if info else []),
              "Plot: [models_bf16.png](models_bf16.png) (eager bf16 time / each variant's time; "
              "black tick = target; right: without AVX512_BF16).", "",
              "### Accuracy and lowering", "", accuracy_table(rows), "", *notes(rows), ""]
    if avx2 is not None:
        extra = (f" Child process: ATen capability {avx2.get('aten_capability')}, Kwker "
                 f"target {avx2.get('kwker_target')}, avx512bf16 "
                 f"{'on' if avx2.get('avx512bf16') else 'off'}." if "env" in avx2 else "")
        lines += ["### Without AVX512_BF16 (AVX2)", "", AVX2_METHOD + extra, "",
                  avx2_table(avx2), ""]
    bad = broken(rows, avx2)
    if bad:
        lines += ["**Accuracy contract broken:**", "", *(f"- {b}" for b in bad), ""]
    return "\n".join(lines)


def _geo(xs):
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def headline(bf16: dict) -> list[dict]:
    """The index's bf16 figures: geomean, the row furthest below its target, the OpenVINO
    rows, and the AVX2 geomean."""
    rows = [r for r in bf16.get("rows", []) if "skipped" not in r]
    out = []

    def add(label, x, target=None):
        if x is not None:
            out.append({"label": label, "ratio": x, **({"target": target} if target else {})})
    best = [(r, best_kwker(r)) for r in rows]
    add(f"bf16: best Kwker vs eager bf16, geomean of {len(rows)} rows",
        _geo(ratio(r, "eager", k) for r, k in best if k))
    targeted = [(ratio(r, "eager", k) / r["target"], r, k) for r, k in best
                if k and r.get("target") and ratio(r, "eager", k)]
    if targeted:
        _, r, k = min(targeted, key=lambda t: t[0])
        add(f"bf16 lowest vs its target: {r['model']} {MODE_LABELS[r['mode']]}",
            ratio(r, "eager", k), r["target"])
    for r, k in best:
        if r.get("beat_openvino") and k and r["mode"] == "bf16":
            add(f"bf16 {r['model']} best Kwker vs OpenVINO bf16", ratio(r, "openvino", k), 1.0)
    avx2 = [r for r in (bf16.get("avx2") or {}).get("rows", []) if "skipped" not in r]
    add(f"AVX2 bf16: Kwker inner=eager vs eager, geomean of {len(avx2)} rows",
        _geo(ratio(r, "eager", "kwker_eager") for r in avx2))
    return out


PLOT_SERIES = ("inductor", "kwker_eager", "kwker", "openvino")
COLORS = {"inductor": "tab:gray", "kwker_eager": "tab:green", "kwker": "tab:olive",
          "openvino": "tab:purple"}


def plot(bf16: dict, path: Path, info: dict) -> bool:
    """Left: per row, eager bf16 time / each variant's time (log), black tick at the target.
    Right: the AVX2 rows, eager bf16 / Kwker inner=eager."""
    plt = common.pyplot()
    if plt is None:
        return False
    rows = [r for r in bf16.get("rows", []) if "skipped" not in r]
    avx2 = [r for r in (bf16.get("avx2") or {}).get("rows", []) if "skipped" not in r]
    series = [v for v in PLOT_SERIES if any(r["ms"].get(v) for r in rows)]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(15, 1.5 + 0.14 * max(1, len(series))
                                                * max(1, len(rows))),
                                  gridspec_kw={"width_ratios": [3, 2]})
    h, seen = 0.8 / max(1, len(series)), set()
    labels = [f"{r['model']} {MODE_LABELS[r['mode']]}" for r in rows]
    for i, r in enumerate(rows):
        y0 = len(rows) - 1 - i
        for j, v in enumerate(series):
            x = ratio(r, "eager", v)
            y = y0 + 0.4 - (j + 0.5) * h
            if v in r.get("failed", {}):
                ax.text(1.02, y, f"{LABELS[v]}: failed", va="center", fontsize=6,
                        color="tab:red")
            if x is None:
                continue
            bad = r.get("contract", {}).get(v, "ok") != "ok"
            ax.barh(y, x, height=h, color=COLORS[v], hatch="//" if bad else None,
                    label=None if v in seen else LABELS[v])
            ax.text(x * 1.02, y, f"{x:.2f}x", va="center", fontsize=6)
            seen.add(v)
        if r.get("target"):
            ax.plot([r["target"]] * 2, [y0 - 0.45, y0 + 0.45], color="black", lw=2)
    ax.axvline(1.0, color="grey", lw=0.8)
    if rows:
        top = [ratio(r, "eager", v) for r in rows for v in series] + \
            [r.get("target") for r in rows]
        common.log_x(ax, right=max([x for x in top if x] + [1.0]) * 1.6)
        ax.set_yticks(range(len(rows)), labels[::-1], fontsize=7)
        ax.legend(fontsize=7, loc="lower right")
    ax.set_xlabel("eager bf16 ms / variant ms (log; black tick = target; hatched = accuracy "
                  "contract broken)", fontsize=8)
    if avx2:
        common.ratio_bars(ax2, [f"{r['model']} {MODE_LABELS[r['mode']]}" for r in avx2],
                          [ratio(r, "eager", "kwker_eager") or 1e-3 for r in avx2],
                          colors=["tab:red" if r.get("contract", {}).get("kwker_eager", "ok")
                                  != "ok" else "tab:green" for r in avx2])
    else:
        ax2.axis("off")
        ax2.text(0.5, 0.5, (bf16.get("avx2") or {}).get("error") or "not run", ha="center",
                 va="center", fontsize=8, wrap=True)
    ax2.set_title("without AVX512_BF16 (AVX2): eager bf16 / Kwker inner=eager", fontsize=8)
    return common.save_plot(fig, path, f"bf16 models vs eager bf16; {common.machine_line(info)}")
