"""Dynamic shapes: a new batch size or sequence length must never wait for an LLVM compile.

Kwker compiles graphs with symbolic sizes into kernels generic over the sizes that vary. Five
sweeps show it, each variant in a child process of its own that starts with an empty Kwker
kernel cache (a fresh ``KWKER_CACHE_DIR``) and a fresh Inductor cache (``--warm-inductor``
keeps the user's), 2 threads, ``torch.no_grad()`` (workloads in dynamic_sweeps.py):

- ``mlp``: MLP 512-2048-512 with GELU at batch 3, 5, ..., 41: first-call latency, steady time,
  LLVM compiles and dynamo graphs, against size-specialised Kwker kernels, Inductor and eager.
- ``ranker``: the tutorial Ranker at every batch 1..64 in a seeded random order.
- ``gpt``: GPT-style decoder with a KV cache (gpt_decoder.py), 32-token prompt, 64 greedy tokens.
- ``memory``: RSS growth of MLP 1024-4096-1024 over 40 batch sizes against its weights.
- ``tel``: TransformerEncoderLayer(256, 8, 1024) under ``dynamic=True`` at lengths 17..200.

    python benchmarks/bench_dynamic.py                        # writes results/dynamic.{md,json}
    python benchmarks/bench_dynamic.py --quick                # fewer sizes and reps, prints only
    python benchmarks/bench_dynamic.py --sections mlp gpt     # some sweeps (others kept)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import dynamic_sweeps

SECTIONS = {
    "mlp": ("kwker_eager", "kwker", "inductor", "spec", "eager"),
    "ranker": ("kwker_eager", "kwker", "kwker_oblivious", "spec", "eager"),
    "gpt": ("eager", "kwker_eager", "kwker", "inductor"),
    "memory": ("eager", "kwker_eager", "kwker"),
    "tel": ("eager", "kwker_eager", "kwker", "inductor"),
}
LABELS = {"eager": "eager", "kwker_eager": "Kwker inner=eager", "kwker": "Kwker (default)",
          "inductor": "Inductor (dynamic)", "spec": "Kwker specialised",
          "kwker_oblivious": "Kwker inner=eager, backed_size_oblivious"}
KWKER = ("kwker_eager", "kwker")
STALL_MS = 5.0        # no first call above this after the second size
COMPILE_S = 2.0       # LLVM seconds per MLP sweep
VS_SPEC, VS_INDUCTOR, INDUCTOR_FLOOR = 0.9, 1.3, 1.0
GPT_FIRST_S = {"kwker_eager": 10.0, "kwker": 20.0}   # first generation <= steady + this
GPT_VS_EAGER = 1.2
MEMORY_X = 2.0        # RSS growth < this x the weights
ERR_TOL = 1e-4        # max abs error against eager that counts as a match
CHILD_TIMEOUT = 3600


# ------------------------------------------------------------------------------ children
def run_child(section: str, mode: str, quick: bool, warm_inductor: bool) -> dict:
    """One variant of one sweep in a fresh process with empty caches; its JSON, or an error."""
    with tempfile.TemporaryDirectory(prefix="kwker-dyn-") as tmp:
        env = {**os.environ, "KWKER_CACHE_DIR": os.path.join(tmp, "kwker")}
        if not warm_inductor:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        cmd = [sys.executable, __file__, "--child", section, mode, *(["--quick"] * quick)]
        t0 = time.perf_counter()
        try:
            res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                 timeout=CHILD_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {CHILD_TIMEOUT} s"}
        lines = res.stdout.strip().splitlines()
        if res.returncode != 0 or not lines:
            return {"error": f"exit {res.returncode} (see stderr)"}
        data = json.loads(lines[-1])
        data["process_s"] = time.perf_counter() - t0
        return data


def run_section(section: str, quick: bool, warm_inductor: bool) -> dict:
    out = {}
    for mode in SECTIONS[section]:
        print(f"== {section}: {LABELS[mode]}", file=sys.stderr, flush=True)
        out[mode] = run_child(section, mode, quick, warm_inductor)
    return out


# ------------------------------------------------------------------------------ figures
def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def by_size(d: dict) -> dict:
    return {r["size"]: r for r in d.get("rows", [])} if d else {}


def ratios(sec: dict, ref: str, mode: str) -> list[float]:
    """ref steady time / mode steady time per size both have (> 1: ``mode`` is faster)."""
    a, b = by_size(sec.get(ref)), by_size(sec.get(mode))
    return [a[s]["steady_ms"] / b[s]["steady_ms"] for s in b if s in a]


def stall_ms(d: dict) -> float | None:
    """Slowest first call after the second size."""
    rows = d.get("rows", [])[2:]
    return max(r["first_ms"] for r in rows) if rows else None


def max_err(d: dict) -> float | None:
    errs = [r["err"] for r in d.get("rows", [])]
    return max(errs) if errs else None


def _x(r):
    return "—" if r is None else f"{r:.2f}x"


def _f(v, fmt="{:.2f}"):
    return "—" if v is None else fmt.format(v)


def _target(section, what, value, met) -> dict:
    return {"section": section, "target": what, "value": value, "met": bool(met)}


def _ran(data: dict, section: str, modes, out: list):
    """(mode, its results, its label) for each of ``modes`` the section ran; a failed target
    in ``out`` for each that it should have run and did not."""
    sec = data.get(section, {})
    for m in modes if sec else ():
        d = sec.get(m, {})
        if "error" in d or not d:
            out.append(_target(section, f"{LABELS[m]} ran", d.get("error", "missing"), False))
            continue
        yield m, d, LABELS[m]


def targets(data: dict) -> list[dict]:
    """Every target of the issue that this run's sections can be held to."""
    out = []
    sec = data.get("mlp", {})
    for m, d, L in _ran(data, "mlp", KWKER, out):
        s, t = stall_ms(d), d["totals"]
        out.append(_target("mlp", f"{L}: no first call > {STALL_MS:g} ms after the 2nd size",
                           f"max {_f(s)} ms", s is not None and s <= STALL_MS))
        out.append(_target("mlp", f"{L}: LLVM compiles <= {COMPILE_S:g} s per sweep",
                           f"{t['compile_s']:.2f} s ({t['llvm_compiles']} compiles)",
                           t["compile_s"] <= COMPILE_S))
        rs, ri = ratios(sec, "spec", m), ratios(sec, "inductor", m)
        out.append(_target("mlp", f"{L}: steady >= {VS_SPEC:g}x specialised kernels (geomean)",
                           f"{_x(geomean(rs))} (min {_x(min(rs, default=None))})",
                           rs and geomean(rs) >= VS_SPEC))
        rp = [r["vs_spec_same_process"] for r in d["rows"] if "vs_spec_same_process" in r]
        if rp:  # the same, interleaved in one process (no process-to-process noise)
            out.append(_target("mlp", f"{L}: its generic kernels >= {VS_SPEC:g}x specialised"
                               " ones (geomean), same process", f"{_x(geomean(rp))} (min "
                               f"{_x(min(rp))})", geomean(rp) >= VS_SPEC))
        out.append(_target("mlp", f"{L}: steady >= {VS_INDUCTOR:g}x Inductor dynamic (geomean),"
                           f" none < {INDUCTOR_FLOOR:g}x",
                           f"{_x(geomean(ri))} (min {_x(min(ri, default=None))})",
                           ri and geomean(ri) >= VS_INDUCTOR and min(ri) >= INDUCTOR_FLOOR))
    sec = data.get("ranker", {})
    for m, d, L in _ran(data, "ranker", (*KWKER, "kwker_oblivious"), out):
        s, rs = stall_ms(d), ratios(sec, "spec", m)
        out.append(_target("ranker", f"{L}: no first call > {STALL_MS:g} ms after the 2nd size",
                           f"max {_f(s)} ms", s is not None and s <= STALL_MS))
        out.append(_target("ranker", f"{L}: steady >= {VS_SPEC:g}x specialised (geomean)",
                           f"{_x(geomean(rs))} (min {_x(min(rs, default=None))})",
                           rs and geomean(rs) >= VS_SPEC))
    sec = data.get("gpt", {})
    eager, ind = sec.get("eager", {}), sec.get("inductor", {})
    for m, d, L in _ran(data, "gpt", KWKER, out):
        extra = d["first_s"] - d["steady_s"]
        out.append(_target("gpt", f"{L}: first generation <= steady + {GPT_FIRST_S[m]:g} s",
                           f"+{extra:.1f} s", extra <= GPT_FIRST_S[m]))
        if eager.get("tok_s"):
            r = d["tok_s"] / eager["tok_s"]
            out.append(_target("gpt", f"{L}: tokens/s >= {GPT_VS_EAGER:g}x eager", _x(r),
                               r >= GPT_VS_EAGER))
            out.append(_target("gpt", f"{L}: same tokens as eager", same_tokens(d, eager),
                               same_tokens(d, eager) == "yes"))
        if ind.get("tok_s"):
            r = d["tok_s"] / ind["tok_s"]
            out.append(_target("gpt", f"{L}: tokens/s >= Inductor's", _x(r), r >= 1.0))
    for m, d, L in _ran(data, "memory", KWKER, out):
        out.append(_target("memory", f"{L}: RSS growth over {len(d['sizes'])} sizes < "
                           f"{MEMORY_X:g}x weights ({d['weights_mb']:.0f} MB)",
                           f"{d['growth_mb']:.1f} MB = {d['growth_mb'] / d['weights_mb']:.2f}x",
                           d["growth_mb"] < MEMORY_X * d["weights_mb"]))
    for m, d, L in _ran(data, "tel", KWKER, out):
        ks = d.get("last_report", {}).get("kernels", [])
        lin = [g for k, g in ks if k.startswith("linear")]
        att = [g for k, g in ks if k == "sdpa"]
        out.append(_target("tel", f"{L}: linears and attention run as generic kernels",
                           f"linear {lin.count('generic')}/{len(lin)}, sdpa "
                           f"{att.count('generic')}/{len(att)} generic",
                           lin and att and set(lin + att) == {"generic"}))
        out.append(_target("tel", f"{L}: matches eager (max abs error <= {ERR_TOL:g})",
                           f"{_f(max_err(d), '{:.1e}')}", (max_err(d) or 0) <= ERR_TOL))
    return out


def same_tokens(d: dict, eager: dict) -> str:
    a, b = d.get("tokens"), eager.get("tokens")
    if a is None or b is None:
        return "—"
    if a == b:
        return "yes"
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"NO (first difference at token {first})"


def headline(data: dict) -> list[dict]:
    """The index's figures: the ratio targets (>= target is met)."""
    out = []
    for m in KWKER:
        for sec, ref, tgt in (("mlp", "spec", VS_SPEC), ("mlp", "inductor", VS_INDUCTOR),
                              ("ranker", "spec", VS_SPEC)):
            g = geomean(ratios(data.get(sec, {}), ref, m))
            if g:
                out.append({"label": f"{sec} {LABELS[m]} vs {LABELS[ref]}", "ratio": g,
                            "target": tgt})
        gpt = data.get("gpt", {})
        if gpt.get(m, {}).get("tok_s") and gpt.get("eager", {}).get("tok_s"):
            out.append({"label": f"GPT decode {LABELS[m]} tokens/s vs eager",
                        "ratio": gpt[m]["tok_s"] / gpt["eager"]["tok_s"],
                        "target": GPT_VS_EAGER})
    return out


def problems(data: dict) -> list[str]:
    """Wrong results and failed children: bugs, not missed targets (exit status 1)."""
    out = []
    for name, sec in data.items():
        for mode, d in sec.items():
            if "error" in d:
                out.append(f"{name}/{mode}: {d['error']}")
            elif (max_err(d) or 0) > ERR_TOL:
                out.append(f"{name}/{mode}: max abs error {max_err(d):.2e} vs eager")
            elif mode == "spec" and any(r.get("kernel_sizes") != ["specialised"]
                                        for r in d["rows"]):
                out.append(f"{name}/spec: the reference ran kernels that are not all "
                           "specialised (see kernel_sizes in the JSON)")
        if name == "gpt":
            out += [f"gpt/{m}: tokens differ from eager" for m in sec
                    if m != "eager" and same_tokens(sec[m], sec.get("eager", {})) not in
                    ("yes", "—")]
    return out


# ------------------------------------------------------------------------------ tables
def sweep_table(sec: dict, size_label: str, markdown=True) -> str:
    """Per size: first-call ms of each compiled variant, steady ms of each, and the ratios."""
    modes = [m for m in sec if "rows" in sec[m]]
    first = [m for m in modes if m not in ("eager", "spec")]
    refs = [r for r in ("spec", "inductor", "eager") if r in modes]
    rows_of = {m: by_size(sec[m]) for m in modes}
    order = [r["size"] for r in sec[next((m for m in first), modes[0])]["rows"]] if modes else []
    headers = [size_label, "first call ms: " + " / ".join(LABELS[m] for m in first),
               "graphs / LLVM compiles at first call",
               *(f"{LABELS[m]} ms" for m in modes),
               *(f"{LABELS[m]} vs {LABELS[r]}" for m in KWKER if m in modes for r in refs)]
    body = []
    for s in order:
        def ms(m, key, s=s):
            return common.fmt_ms(rows_of[m][s][key] / 1e3) if s in rows_of[m] else "—"
        events = " / ".join(f"{rows_of[m][s]['graphs']}g {rows_of[m][s]['llvm']}c"
                            if s in rows_of[m] else "—" for m in first)
        rats = []
        for m in (m for m in KWKER if m in modes):
            for r in refs:
                a, b = rows_of[r].get(s), rows_of[m].get(s)
                rats.append(_x(a["steady_ms"] / b["steady_ms"]) if a and b else "—")
        body.append([s, " / ".join(ms(m, "first_ms") for m in first), events,
                     *(ms(m, "steady_ms") for m in modes), *rats])
    return (common.md_table if markdown else common.text_table)(headers, body)


def _variant_rows(sec: dict, headers: list, body: list):
    """(mode, results, totals) per variant of a section; a variant that failed gets its error
    row in ``body`` instead."""
    for m, d in sec.items():
        if "error" in d:
            body.append([LABELS[m], f"ERROR: {d['error']}", *["—"] * (len(headers) - 2)])
            continue
        yield m, d, d["totals"]


def totals_table(sec: dict, markdown=True) -> str:
    """Per variant: what the whole sweep compiled, the worst first call, the ratios' geomeans."""
    refs = [r for r in ("spec", "inductor", "eager") if "rows" in sec.get(r, {})]
    headers = ["variant", "LLVM compiles", "compile s", "dynamo graphs",
               "max first call after 2nd size ms", "Kwker kernels (all reports)", "max abs err",
               *(f"vs {LABELS[r]} geomean (min)" for r in refs)]
    body = []
    for m, d, t in _variant_rows(sec, headers, body):
        kern = ", ".join(f"{k} x{n}" for k, n in d.get("kernels", {}).items()) or "—"
        rats = []
        for r in refs:
            rs = ratios(sec, r, m) if m in KWKER else []
            rats.append(f"{_x(geomean(rs))} ({_x(min(rs))})" if rs else "—")
        body.append([LABELS[m], t["llvm_compiles"], f"{t['compile_s']:.2f}", t["dynamo_graphs"],
                     _f(stall_ms(d)) if m not in ("eager", "spec") else "—", kern,
                     _f(max_err(d), "{:.1e}"), *rats])
    return (common.md_table if markdown else common.text_table)(headers, body)


def gpt_table(sec: dict, markdown=True) -> str:
    eager, ind = sec.get("eager", {}), sec.get("inductor", {})
    headers = ["variant", "first generation s", "steady generation s", "first - steady s",
               "tokens/s", "vs eager", "vs Inductor", "same tokens as eager",
               "dynamo graphs", "LLVM compiles", "compile s"]
    body = []
    for m, d, t in _variant_rows(sec, headers, body):
        body.append([LABELS[m], f"{d['first_s']:.2f}", f"{d['steady_s']:.3f}",
                     f"{d['first_s'] - d['steady_s']:.2f}", f"{d['tok_s']:.0f}",
                     _x(d["tok_s"] / eager["tok_s"]) if eager.get("tok_s") else "—",
                     _x(d["tok_s"] / ind["tok_s"]) if ind.get("tok_s") else "—",
                     "(reference)" if m == "eager" else same_tokens(d, eager),
                     t["dynamo_graphs"], t["llvm_compiles"], f"{t['compile_s']:.2f}"])
    return (common.md_table if markdown else common.text_table)(headers, body)


def memory_table(sec: dict, markdown=True) -> str:
    headers = ["variant", "sizes", "weights MB", "RSS after 1st call MB", "after 2nd MB",
               "after last MB", "growth 1st -> last MB", "growth / weights", "peak growth MB",
               "LLVM compiles", "dynamo graphs"]
    body = []
    for m, d in sec.items():
        if "error" in d:
            body.append([LABELS[m], f"ERROR: {d['error']}", *["—"] * (len(headers) - 2)])
            continue
        rss, t = d["rss_mb"], d["totals"]
        body.append([LABELS[m], len(d["sizes"]), f"{d['weights_mb']:.1f}", f"{rss[0]:.0f}",
                     f"{rss[1]:.0f}" if len(rss) > 1 else "—", f"{rss[-1]:.0f}",
                     f"{d['growth_mb']:.1f}", f"{d['growth_mb'] / d['weights_mb']:.2f}x",
                     f"{d['peak_growth_mb']:.1f}", t["llvm_compiles"], t["dynamo_graphs"]])
    return (common.md_table if markdown else common.text_table)(headers, body)


def targets_table(ts: list[dict], markdown=True) -> str:
    rows = [[t["section"], t["target"], t["value"], "met" if t["met"] else "**NOT met**"]
            for t in ts]
    return (common.md_table if markdown else common.text_table)(
        ["sweep", "target", "value", "status"], rows)


def tel_kernels(sec: dict) -> list[str]:
    out = []
    for m in KWKER:
        rep = sec.get(m, {}).get("last_report")
        if rep:
            ks = ", ".join(f"{k} ({g})" for k, g in rep["kernels"]) or "none"
            out.append(f"- {LABELS[m]}, graph [{rep['shapes']}]: {ks}"
                       + (f"; missed: {rep['missed']}" if rep["missed"] else ""))
    return out


TITLES = {
    "mlp": ("MLP 512-2048-512 (GELU), batch 3, 5, ..., 41", "batch"),
    "ranker": ("Tutorial Ranker, every batch 1..64 in a seeded random order", "batch"),
    "tel": ("TransformerEncoderLayer(256, 8, 1024) under `dynamic=True`, batch 8", "length"),
}
METHOD = (
    "Each variant runs in a child process of its own, started with an empty Kwker kernel "
    "cache (fresh `KWKER_CACHE_DIR`){ind}, 2 threads, `torch.no_grad()`, float32. Sizes are "
    "visited in the order listed: the *first call* at a size is the latency a user sees when it "
    "arrives (with any dynamo recompile, Inductor compile and LLVM compile it triggers: `g` = new "
    "dynamo graphs, `c` = LLVM compiles in that call); *steady* is the best per-call time "
    "(`common.compare`, samples of >= 2 ms) after the sweep. *Kwker specialised* is the "
    "reference for what generic kernels cost: per size `torch._dynamo.reset()` and a fresh "
    "`torch.compile(model, backend=\"kwker\", options={{\"inner\": \"eager\"}}, dynamic=False)`, "
    "which builds kernels specialised to that size. Ratios = reference ms / Kwker ms (> 1: Kwker "
    "faster). Variants are timed in different processes, so on a loaded machine ratios are "
    "noisier than the interleaved ones of models.md.")


def markdown(data: dict) -> str:
    info, extra = data["machine"], data["run"]
    ind = "" if extra.get("warm_inductor") else " and an empty Inductor cache"
    run_all = set(extra.get("sections_run", SECTIONS)) == set(SECTIONS)
    lines = ["# Dynamic shapes: new sizes without new compiles", "",
             (f"`python benchmarks/bench_dynamic.py{' --quick' * extra.get('quick', False)}"
              f"{'' if run_all else ' --sections ' + ' '.join(extra['sections_run'])}` — "
              f"lscpu model name {extra['cpu_model']}, AVX512_BF16 "
              f"{'yes' if extra['avx512_bf16'] else 'no'}; {common.machine_line(info)}, "
              f"{extra.get('load_end', '?')} at end."), "",
             METHOD.format(ind=ind), ""]
    secs = data["sections"]
    if data.get("targets"):
        lines += ["## Targets", "", targets_table(data["targets"]), ""]
    for name in ("mlp", "ranker", "tel"):
        if name in secs:
            title, label = TITLES[name]
            lines += [f"## {title}", "", sweep_table(secs[name], label), "",
                      totals_table(secs[name]), ""]
            if name == "tel":
                lines += [("Kernels of the last graph each Kwker variant compiled "
                           "(`kwker.dynamo.last_report()`):"), "", *tel_kernels(secs[name]), ""]
    if "gpt" in secs:
        g = next((d for d in secs["gpt"].values() if "n_tokens" in d), {})
        lines += [(f"## GPT-style decoder with KV cache: prompt {g.get('prompt', '?')}, "
                   f"{g.get('n_tokens', '?')} greedy tokens, batch 1"), "",
                  ("gpt_decoder.py defaults (6 layers, d=384, 6 heads, vocab 8192). First "
                   "generation includes every compile; steady = best of later generations; "
                   "tokens/s = generated tokens / steady generation time (prompt included)."), "",
                  gpt_table(secs["gpt"]), ""]
    if "memory" in secs:
        lines += ["## Memory: MLP 1024-4096-1024 over many batch sizes", "",
                  ("VmRSS (`/proc/self/status`) after each call; growth from after the first "
                   "call to after the last, in a process per variant."), "",
                  memory_table(secs["memory"]), ""]
    return "\n".join(lines)


def print_tables(secs: dict) -> None:
    for name, sec in secs.items():
        print(f"\n{name}")
        if name in TITLES:
            print(sweep_table(sec, TITLES[name][1], markdown=False))
            print(totals_table(sec, markdown=False))
        elif name == "gpt":
            print(gpt_table(sec, markdown=False))
        else:
            print(memory_table(sec, markdown=False))


# ------------------------------------------------------------------------------ main
def cpu_model() -> tuple[str, bool]:
    """lscpu's Model name and whether the CPU has AVX512_BF16."""
    name = "?"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                     if ln.startswith("Model name")), "?")
    try:
        bf16 = "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        bf16 = False
    return name, bf16


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and reps, no files")
    ap.add_argument("--sections", nargs="+", choices=tuple(SECTIONS), default=list(SECTIONS))
    ap.add_argument("--warm-inductor", action="store_true",
                    help="keep the user's Inductor cache (default: an empty one per variant)")
    common.add_out_argument(ap)
    ap.add_argument("--child", nargs=2, metavar=("SECTION", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(dynamic_sweeps.run(*args.child, args.quick)))
        return 0
    common.set_threads()
    info = common.machine_info()
    name, bf16 = cpu_model()
    out = args.out or (None if args.quick else common.RESULTS)
    old = {}
    if out is not None:
        with contextlib.suppress(OSError, ValueError):
            old = json.loads((out / "dynamic.json").read_text())
    secs = {k: v for k, v in old.get("sections", {}).items() if k not in args.sections}
    t0 = time.perf_counter()
    for section in args.sections:
        secs[section] = run_section(section, args.quick, args.warm_inductor)
        print_tables({section: secs[section]})
    secs = {k: secs[k] for k in SECTIONS if k in secs}
    data = {"benchmark": "dynamic", "script": "bench_dynamic.py", "machine": info,
            "run": {"cpu_model": name, "avx512_bf16": bf16, "quick": args.quick,
                    "warm_inductor": args.warm_inductor, "load_end": common.load(),
                    "sections_run": args.sections, "seconds": time.perf_counter() - t0},
            "sections": secs}
    data["targets"] = targets(secs)
    data["headline"] = headline(secs)
    print()
    print(targets_table(data["targets"], markdown=False))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "dynamic.md").write_text(markdown(data))
        common.write_json(out / "dynamic.json", data)
        print(f"wrote {out / 'dynamic.md'}, dynamic.json")
    bad = problems(secs)
    for b in bad:
        print(f"PROBLEM (bug): {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
