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

Compile times are measured for the tutorial model unless ``--compile-times all`` (each costs two
fresh processes per compiler, minutes for all models with cold Inductor caches).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

VARIANTS = ("eager", "inductor", "kwker_eager", "kwker")
PEERS = ("onnxruntime", "openvino")
LABELS = {"eager": "PyTorch eager", "inductor": "Inductor", "kwker_eager": "Kwker inner=eager",
          "kwker": "Kwker (default)", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}
# what each peer needs importable (ONNX Runtime runs the torch.onnx export, which needs onnx and
# onnxscript; OpenVINO converts the torch module itself, the ONNX file only as a fallback)
PEER_MODULES = {"onnxruntime": ("onnxruntime", "onnx", "onnxscript"), "openvino": ("openvino",)}
NOT_INSTALLED = 'not installed: pip install -e ".[bench]"'
SETTLE = 0.04  # s between samples when peers run: ONNX Runtime's idle workers spin ~30 ms
OVERHEAD_TARGET_US = 20.0  # issue 4: per-call cost over the kernels, tutorial model, inner=eager


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


def _timed(sides, reps: int, rounds: int, settle: float = 0.0) -> list[float]:
    """Best seconds per call of each side over a few interleaved rounds, a second apart (on a
    shared machine one round can be disturbed)."""
    best = [float("inf")] * len(sides)
    for r in range(rounds):
        if r:
            time.sleep(1.0)
        best = [min(b, t) for b, t in zip(best, common.compare(sides, reps=reps, warmup=3,
                                                                settle=settle))]
    return best


def speed(name: str, reps: int, rounds: int, peers=PEERS) -> dict:
    model, inputs = build(name)
    row = {"model": name, "ms": {}, "check": {}, "kernels": "", "peers": {}}
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
        for variant in VARIANTS:
            torch._dynamo.reset()
            fn = compile_variant(model, variant)
            got = fn(*inputs)
            row["check"][variant] = "ok" if variant == "eager" else check(name, expected, got)
            if variant == "kwker_eager":
                import kwker.dynamo as kd
                row["kernels"] = ", ".join(kd.last_report().kernel_names)
            sides.append(common.Side(variant, lambda fn=fn: fn(*inputs), torch.no_grad))
        sides += [common.Side(p, fn, torch.no_grad) for p, fn in calls.items()]
        # the peers' thread pools are not torch's: let each side's spinning threads go idle
        # before the next side's sample (see common._sample)
        settle = SETTLE if calls else 0.0
        for side, t in zip(sides, _timed(sides, reps, rounds, settle)):
            row["ms"][side.name] = t * 1e3
    return row


# ------------------------------------------------------------------------------- peers
def peer_missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here (a package it needs is not importable), or None."""
    absent = [m for m in PEER_MODULES[peer] if importlib.util.find_spec(m) is None]
    return f"{NOT_INSTALLED} ({', '.join(absent)} missing)" if absent else None


@contextlib.contextmanager
def _quiet():
    """Silence the converters' warnings and log lines (torchvision absent, deprecations)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_onnx(model, inputs, path: str) -> str:
    """Write ``model`` to ``path`` as ONNX; return which exporter did it: torch's dynamo-based
    exporter (its recommended one) or, when that fails, the TorchScript one."""
    with _quiet():
        try:
            torch.onnx.export(model, inputs, path, dynamo=True, verbose=False)
            return "torch.onnx dynamo export"
        except Exception as e:  # noqa: BLE001 - any failure: the legacy exporter may still work
            why = type(e).__name__
        torch.onnx.export(model, inputs, path, dynamo=False)
    return f"torch.onnx TorchScript export (the dynamo exporter failed: {why})"


def _to_torch(outs):
    """The peers' numpy outputs as torch tensors (zero-copy), a tuple when there are several."""
    out = tuple(torch.from_numpy(o) for o in outs)
    return out if len(out) > 1 else out[0]


def onnxruntime_call(model, inputs, onnx_file):
    """(call, how): an ONNX Runtime session on the exported model, CPU execution provider, all
    graph optimisations, sequential execution, torch's thread count."""
    import onnxruntime as ort

    path, how = onnx_file()
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]

    def run():
        return _to_torch(sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)}))
    return run, how


def openvino_call(model, inputs, onnx_file):
    """(call, how): OpenVINO's CPU plugin on the converted torch module (the ONNX file when the
    module does not convert), latency hint, torch's thread count, float32 inference. OpenVINO's
    default on a CPU with AVX-512 BF16 is bf16, whose results differ from eager's by ~1e-3."""
    import openvino as ov

    with _quiet():
        try:
            converted, how = ov.convert_model(model, example_input=inputs), "convert_model(module)"
        except Exception as e:  # noqa: BLE001 - e.g. TorchScript tracing fails: use ONNX
            path, exported = onnx_file()
            converted = ov.convert_model(path)
            how = (f"convert_model(ONNX file from {exported}); the module did not convert: "
                   f"{type(e).__name__}")
    compiled = ov.Core().compile_model(converted, "CPU", {
        "INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERFORMANCE_HINT": "LATENCY",
        "INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()

    def run():
        res = request.infer([t.numpy() for t in inputs], share_inputs=True)
        return _to_torch(res.to_tuple())
    return run, how + ", f32"


PEER_BUILDERS = {"onnxruntime": onnxruntime_call, "openvino": openvino_call}


# --------------------------------------------------------------------- per-call overhead
def overhead(name: str, reps: int, rounds: int) -> dict:
    """Microseconds per call of the compiled graph (inner=eager) and of its parts.

    (a) the ``torch.compile``'d model; (b) the callable Kwker handed dynamo, called directly with
    dynamo's example inputs; (c) its kernel steps alone, back to back on a filled slot list.
    (b)-(c) is Kwker's own cost over its kernels, (a)-(b) dynamo's frame evaluation and guards,
    which every backend pays (compared with a do-nothing backend returning ``gm.forward``). Both
    shares are also timed directly, which a difference of two ~1 ms times cannot do to the µs:
    Kwker's as its program with each kernel step replaced by storing that kernel's result,
    dynamo's as a backend whose graph returns stored outputs.
    """
    import kwker.dynamo as kd
    from kwker.lowering.runner import Program

    model, inputs = build(name)
    got = {}

    def keep(key, make):
        def backend(gm, example_inputs):
            got[key] = (gm, make(gm, example_inputs), list(example_inputs))
            return got[key][1]
        return backend

    def stored(gm, example_inputs):
        out = gm.forward(*example_inputs)
        return lambda *args: out

    with torch.no_grad():
        torch._dynamo.reset()
        compiled = {key: torch.compile(model, backend=keep(key, make)) for key, make in (
            ("kwker", lambda gm, ex: kd.backend(gm, ex, options={"inner": "eager"})),
            ("noop", lambda gm, ex: gm.forward), ("stored", stored))}
        for fn in compiled.values():
            fn(*inputs)
        _, graph, args = got["kwker"]
        plan = getattr(graph, "plan", None)
        if plan is None or not plan.valid(args):
            return {"model": name, "error": f"no static Kwker plan ({type(graph).__name__})"}
        program = plan.program
        # run every step once without freeing slots: each step's inputs stay available, and the
        # slot each step writes is found by comparing the slot list before and after it
        env = program.template.copy()
        env[:program.n_inputs] = args
        writes = []
        for step, _ in program.steps:
            before = list(env)
            step(env)
            writes.append(next((i for i, (a, b) in enumerate(zip(before, env)) if a is not b),
                               None))
        kernels = [s for s, _ in program.steps if getattr(s, "kernel", None)]

        def store(slot, value):
            def step(e):
                e[slot] = value
            return step

        stubbed = Program(program.n_inputs, program.template, [
            (store(slot, env[slot]) if getattr(s, "kernel", None) else s, dead)
            for (s, dead), slot in zip(program.steps, writes)], program.output)

        def kernels_only():
            for s in kernels:
                s(env)

        gm_noop, _, args_noop = got["noop"]
        groups = [  # sides of similar cost, interleaved within a group
            [("compiled", lambda: compiled["kwker"](*inputs)), ("graph", lambda: graph(*args)),
             ("kernels", kernels_only)],
            [("own_direct", lambda: stubbed(args)),
             ("dynamo_direct", lambda: compiled["stored"](*inputs))],
            [("noop_compiled", lambda: compiled["noop"](*inputs)),
             ("noop_forward", lambda: gm_noop.forward(*args_noop))]]
        us = {}
        for group in groups:
            sides = [common.Side(k, fn, torch.no_grad) for k, fn in group]
            us.update({s.name: t * 1e6 for s, t in zip(sides, _timed(sides, reps, rounds))})
        us["inside"] = _dynamo_inside_us(compiled["kwker"], inputs, type(graph), reps * rounds)
    return {
        "model": name, "steps": len(program.steps), "kernel_steps": len(kernels),
        "compiled_us": us["compiled"], "graph_us": us["graph"], "kernels_us": us["kernels"],
        "kwker_own_us": us["graph"] - us["kernels"], "kwker_own_direct_us": us["own_direct"],
        "dynamo_us": us["compiled"] - us["graph"], "dynamo_direct_us": us["dynamo_direct"],
        "noop_dynamo_us": us["noop_compiled"] - us["noop_forward"],
        "total_us": us["compiled"] - us["kernels"], "dynamo_inside_us": us["inside"],
        "total_inside_us": us["inside"] + us["own_direct"], "target_us": OVERHEAD_TARGET_US}


def _dynamo_inside_us(compiled, inputs, graph_type, calls: int) -> float:
    """Dynamo's share timed inside real calls: from the compiled call's start to Kwker's graph
    being entered, plus from the graph's return to the call's end (the least over ``calls``);
    a difference of two separately timed ~0.5 ms calls cannot resolve it."""
    stamps = []
    call = graph_type.__call__

    def stamped(self, *args):
        t1 = time.perf_counter_ns()
        out = call(self, *args)
        stamps.append((t1, time.perf_counter_ns()))
        return out
    graph_type.__call__ = stamped
    try:
        best = float("inf")
        for _ in range(max(calls, 50)):
            stamps.clear()
            t0 = time.perf_counter_ns()
            compiled(*inputs)
            t3 = time.perf_counter_ns()
            t1, t2 = stamps[0]
            best = min(best, (t1 - t0) + (t3 - t2))
    finally:
        graph_type.__call__ = call
    return best / 1e3


OVERHEAD_ROWS = (  # (label, key, checked against the target)
    ("(a) compiled model call: torch.compile(model, backend='kwker', inner='eager')",
     "compiled_us", False),
    ("(b) Kwker's compiled graph called directly (parameter guards, then its {steps} steps)",
     "graph_us", False),
    ("(c) its {kernel_steps} kernel steps alone, back to back", "kernels_us", False),
    ("(b) - (c): Kwker's graph overhead over the kernels", "kwker_own_us", True),
    ("  timed directly: the program with each kernel step replaced by storing its result",
     "kwker_own_direct_us", True),
    ("(a) - (b): dynamo frame + guards (every torch.compile backend pays it)", "dynamo_us",
     False),
    ("  same for a do-nothing backend (gm.forward): its compiled call - gm.forward",
     "noop_dynamo_us", False),
    ("  timed directly: a backend whose graph returns stored outputs", "dynamo_direct_us",
     False),
    ("(a) - (c): total per-call cost over the kernels", "total_us", False),
    ("dynamo's share timed inside each call (start to graph entry, graph return to end)",
     "dynamo_inside_us", False),
    ("total per-call cost over the kernels: dynamo's share inside the call + Kwker's own "
     "(directly timed)", "total_inside_us", True),
)


def overhead_table(o: dict, markdown: bool = True) -> str:
    if "error" in o:
        return f"Per-call overhead of {o['model']} not measured: {o['error']}"
    rows = []
    for label, key, checked in OVERHEAD_ROWS:
        mark = ""
        if checked:
            met = "met" if o[key] < o["target_us"] else "NOT met"
            mark = f"target < {o['target_us']:g} µs: {met}"
        rows.append([label.format(**o), f"{o[key]:.1f}", mark])
    return (common.md_table if markdown else common.text_table)(["", "µs", ""], rows)


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
        body.append([r["model"], *(common.fmt_ms(ms[v] / 1e3) for v in VARIANTS),
                     _x(_ratio(ms, "eager", "kwker_eager")), _x(_ratio(ms, "eager", "kwker")),
                     *(f"{_s(ct.get(v, {}).get('cold'))} / {_s(ct.get(v, {}).get('warm'))}"
                       if v in ct else "—" for v in ("inductor", "kwker_eager", "kwker")),
                     "; ".join(bad) or "ok"])
    return (common.md_table if markdown else common.text_table)(headers, body)


def peer_table(rows, markdown=True):
    """Kwker against ONNX Runtime and OpenVINO: peer ms / Kwker ms, > 1 means Kwker is faster."""
    kw = ("kwker_eager", "kwker")
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
        body.append([r["model"], *(common.fmt_ms(ms[k] / 1e3) for k in kw),
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
OVERHEAD_METHOD = (
    "What a call costs beyond the kernels: Kwker's share (its step list, slot "
    "handling, the non-kernel ATen calls such as unpacking a tuple) and dynamo's "
    "(frame evaluation and guards), which every `torch.compile` backend pays. "
    "Best of interleaved samples. The directly timed rows run that code alone, "
    "with warm caches and idle threads; the differences also include what it "
    "costs to run it right after the kernels (caches emptied by their data, the "
    "OpenMP workers still spinning, which matters on a loaded machine) and are "
    "noisy to a few µs.")


def markdown(rows, info, reps, over=None, rounds=3) -> str:
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
        table(rows), "",
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer reps, no results files")
    ap.add_argument("--compile-times", choices=("tutorial", "all", "none"), default="tutorial")
    ap.add_argument("--models", nargs="*", help="subset of model names")
    ap.add_argument("--no-peers", action="store_true", help="skip ONNX Runtime and OpenVINO")
    ap.add_argument("--probe", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=f"results directory (default {common.RESULTS})")
    args = ap.parse_args(argv)
    if args.probe:
        probe(*args.probe)
        return 0
    common.set_threads()
    info = common.machine_info()
    reps = 5 if args.quick else 20
    rounds = 1 if args.quick else 3
    names = args.models or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    rows = []
    for name in names:
        row = speed(name, reps, rounds, () if args.no_peers else PEERS)
        if args.compile_times == "all" or (args.compile_times == "tutorial" and name == TUTORIAL):
            row["compile"] = {v: compile_times(name, v) for v in ("inductor", "kwker_eager",
                                                                  "kwker")}
        rows.append(row)
        print(table([row], markdown=False).splitlines()[-1], flush=True)
    over = overhead(TUTORIAL, reps, rounds) if TUTORIAL in names else None
    print()
    print(table(rows, markdown=False))
    print()
    print(peer_table(rows, markdown=False))
    print("\n".join(peer_notes(rows)))
    if over:
        print()
        print(overhead_table(over, markdown=False))
    out = args.out or (None if args.quick else common.RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "models.md").write_text(markdown(rows, info, reps, over, rounds))
        common.write_json(out / "models.json", {
            "benchmark": "models", "script": "bench_models.py", "machine": info, "reps": reps,
            "rows": rows, "overhead": over, "headline": headline(rows, over)})
        plot(rows, out / "models.png", info)
        print(f"wrote {out / 'models.md'}, models.json, models.png")
    wrong = [r["model"] for r in rows
             if any(c != "ok" for v, c in r["check"].items() if v in VARIANTS)]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
