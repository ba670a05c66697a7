"""The workloads of bench_dynamic.py: one sweep of one variant, run in a child process.

Each child starts with empty Kwker (and, unless told otherwise, Inductor) caches, set up by the
parent through ``KWKER_CACHE_DIR``/``TORCHINDUCTOR_CACHE_DIR``, so every LLVM compile a sweep
needs happens inside it and is counted (``kwker.runtime.kernel.stats``), and the RSS of the
memory sweep is not polluted by other sweeps. ``run(section, mode, quick)`` returns a JSON-able
dict; sizes are visited in the listed order, each timed once at its first call (the latency a
user sees when a new batch size or length arrives), then all again at steady state.

Variants (``mode``): ``eager``; ``kwker_eager`` / ``kwker`` (``torch.compile(backend="kwker")``
with inner eager / the default inner Inductor; ``kwker_oblivious``: inner eager with torch's
``torch.fx.experimental._config.backed_size_oblivious = True``, under which dynamo does not give
size 1 a graph of its own); ``inductor`` (plain ``torch.compile``); ``spec``,
the size-specialised reference: per size ``torch._dynamo.reset()`` and a fresh
``torch.compile(backend="kwker", options={"inner": "eager"}, dynamic=False)``. With no generic
kernel in the process or its cache the static path compiles kernels specialised to each size.
"""
from __future__ import annotations

import gc
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from gpt_decoder import GPTDecoder, generate
from model_defs import Ranker

MODES = ("eager", "kwker_eager", "kwker", "inductor", "spec", "kwker_oblivious")
MLP_SIZES = list(range(3, 42, 2))                    # 3, 5, ..., 41
RANKER_SIZES = list(range(1, 65))                    # shuffled with RANKER_SEED
RANKER_SEED = 0
GPT_PROMPT, GPT_TOKENS = 32, 64
MEMORY_SIZES = list(range(1, 33)) + [48, 64, 96, 128, 160, 192, 224, 256]  # 40 sizes
TEL_LENGTHS, TEL_BATCH = [17, 29, 64, 101, 150, 200], 8


def sizes(section: str, quick: bool) -> list[int]:
    """The sizes a sweep visits, in order (``quick``: a few, same rules)."""
    if section == "mlp":
        return MLP_SIZES[:5] if quick else MLP_SIZES
    if section == "ranker":
        order = random.Random(RANKER_SEED).sample(RANKER_SIZES, len(RANKER_SIZES))
        return order[:6] if quick else order
    if section == "memory":
        return MEMORY_SIZES[::4] if quick else MEMORY_SIZES
    if section == "tel":
        return TEL_LENGTHS[::2] + TEL_LENGTHS[-1:] if quick else TEL_LENGTHS
    return []


def compiled(model, mode: str, dynamic: bool | None = None):
    if mode == "eager":
        return model
    if mode == "inductor":
        return torch.compile(model, dynamic=dynamic)
    if mode == "spec":
        return torch.compile(model, backend="kwker", options={"inner": "eager"}, dynamic=False)
    if mode == "kwker_oblivious":  # dynamo then does not specialise size 1 (torch's switch)
        import torch.fx.experimental._config as fx_config
        fx_config.backed_size_oblivious = True
    options = {"inner": "eager"} if mode in ("kwker_eager", "kwker_oblivious") else None
    return torch.compile(model, backend="kwker", options=options, dynamic=dynamic)


# ------------------------------------------------------------------------------ counting
def counts() -> dict:
    """LLVM compiles and their seconds, kernel loads from the disk cache, graphs compiled."""
    from torch._dynamo.utils import counters

    import kwker.dynamo as kd
    from kwker.runtime.kernel import stats
    return {"llvm_compiles": stats["misses"], "compile_s": stats["compile_seconds"],
            "cache_loads": stats["hits"], "dynamo_graphs": counters["stats"]["unique_graphs"],
            "kwker_graphs": len(kd.all_reports())}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def kernels() -> dict:
    """Kwker kernels of every graph compiled so far: ``"name (generic|specialised)": count``."""
    import kwker.dynamo as kd
    out: dict = {}
    for r in kd.all_reports():
        for name, _, _, size in r.kernels:
            key = f"{name} ({size})"
            out[key] = out.get(key, 0) + 1
    return out


def max_err(got, expected) -> float:
    """Max abs difference of the (first) outputs; for top-k, of the values."""
    g = got[0] if isinstance(got, (tuple, list)) else got
    e = expected[0] if isinstance(expected, (tuple, list)) else expected
    return (g.float() - e.float()).abs().max().item()


def steady(fn, args, reps: int) -> float:
    """Best seconds per call, ``common.compare`` (warm-up, then samples of >= 2 ms)."""
    return common.compare([common.Side("x", lambda: fn(*args))], reps=reps)[0]


def first_call(fn, args, log) -> tuple[dict, object]:
    """(row with first-call ms and what that call compiled, output)."""
    before = counts()
    t0 = time.perf_counter()
    out = fn(*args)
    dt = time.perf_counter() - t0
    d = delta(before, counts())
    row = {"first_ms": dt * 1e3, "graphs": d["dynamo_graphs"], "llvm": d["llvm_compiles"]}
    log(f"  first call {row['first_ms']:9.2f} ms, {row['graphs']} new graph(s), "
        f"{row['llvm']} LLVM compile(s)")
    return row, out


# ------------------------------------------------------------------------------ sweeps
def sweep(model, inputs: dict, mode: str, reps: int, log, dynamic=None) -> list[dict]:
    """First call at every size in ``inputs`` order, then steady time at every size."""
    rows = []
    fn = None if mode == "spec" else compiled(model, mode, dynamic)
    for size, args in inputs.items():
        log(f"{mode} size {size}:")
        if mode == "spec":  # a fresh static compile per size, timed right away
            torch._dynamo.reset()
            fn = compiled(model, mode)
        row, out = first_call(fn, args, log)
        row.update(size=size, err=max_err(out, model(*args)))
        if mode == "spec":
            import kwker.dynamo as kd
            row["kernel_sizes"] = sorted(set(kd.last_report().kernel_sizes))
            row["steady_ms"] = steady(fn, args, reps) * 1e3
        rows.append(row)
    for row in rows if mode != "spec" else ():
        row["steady_ms"] = steady(fn, inputs[row["size"]], reps) * 1e3
    return rows


def mlp_model(d_in: int, d_hidden: int):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_in)).eval()


def run_mlp(mode, quick, log):
    model = mlp_model(512, 2048)
    inputs = {b: (torch.randn(b, 512),) for b in sizes("mlp", quick)}
    rows = sweep(model, inputs, mode, 5 if quick else 20, log)
    out = {"rows": rows}
    if mode in ("kwker_eager", "kwker"):
        before = counts()
        same_process_reference(model, inputs, rows, 5 if quick else 20, log)
        out["reference_counts"] = delta(before, counts())  # not the sweep's: taken out
    return out


def same_process_reference(model, inputs, rows, reps, log):
    """The model's two linears on kernels generic over the rows against kernels specialised to
    each size, interleaved in this process (processes differ by ~10% on their own, and the
    compiled model's per-call overhead is not what differs). Built after the sweep, so these
    compiles do not touch its first calls."""
    from kwker.kernels.linear import make_linear
    first, second = model[0], model[2]
    g1 = make_linear(first.weight, first.bias, None, epilogue="gelu")
    g2 = make_linear(second.weight, second.bias, None)
    for row in rows:
        b = row["size"]
        s1 = make_linear(first.weight, first.bias, b, epilogue="gelu")
        s2 = make_linear(second.weight, second.bias, b)
        (x,) = inputs[b]
        gen, spec = common.compare([common.Side("generic", lambda x=x: g2(g1(x))),
                                    common.Side("specialised", lambda x=x, s1=s1, s2=s2:
                                                s2(s1(x)))], reps=reps)
        row["vs_spec_same_process"] = spec / gen
        log(f"size {b}: generic kernels vs specialised, same process: {spec / gen:.2f}x")


def run_ranker(mode, quick, log):
    torch.manual_seed(0)
    model = Ranker().eval()
    inputs = {b: (torch.randn(b, 64),) for b in sizes("ranker", quick)}
    return {"rows": sweep(model, inputs, mode, 3 if quick else 10, log)}


def run_tel(mode, quick, log):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, 1024, dropout=0.0, batch_first=True).eval()
    inputs = {n: (torch.randn(TEL_BATCH, n, 256),) for n in sizes("tel", quick)}
    rows = sweep(layer, inputs, mode, 3 if quick else 10, log, dynamic=True)
    out = {"rows": rows}
    if mode.startswith("kwker"):
        import kwker.dynamo as kd
        r = kd.last_report()
        out["last_report"] = {"summary": r.summary(), "shapes": r.shapes,
                              "kernels": [[k[0], k[3]] for k in r.kernels],
                              "missed": [list(m) for m in r.missed]}
    return out


def run_gpt(mode, quick, log):
    torch.manual_seed(0)
    model = GPTDecoder().eval()
    prompt = torch.randint(0, model.tok.num_embeddings, (1, GPT_PROMPT))
    tokens = 8 if quick else GPT_TOKENS
    fn = compiled(model, mode)
    before = counts()
    t0 = time.perf_counter()
    out = generate(fn, prompt, tokens)
    first = time.perf_counter() - t0
    log(f"{mode}: first generation {first:.2f} s")
    d = delta(before, counts())
    times = []
    for _ in range(2 if quick else 5):
        t0 = time.perf_counter()
        again = generate(fn, prompt, tokens)
        times.append(time.perf_counter() - t0)
        if not torch.equal(again, out):
            log(f"{mode}: a later generation differs from the first")
    log(f"{mode}: steady {min(times):.3f} s")
    return {"tokens": out[0].tolist(), "n_tokens": tokens, "prompt": GPT_PROMPT,
            "first_s": first, "steady_s": min(times), "tok_s": tokens / min(times),
            "graphs": d["dynamo_graphs"]}


def run_memory(mode, quick, log):
    model = mlp_model(1024, 4096)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    fn = compiled(model, mode)
    rss = []
    for b in sizes("memory", quick):
        fn(torch.randn(b, 1024))
        gc.collect()
        rss.append(common.rss_mb())
        log(f"{mode} batch {b}: RSS {rss[-1]:.1f} MB")
    return {"sizes": sizes("memory", quick), "rss_mb": rss, "weights_mb": weights,
            "growth_mb": rss[-1] - rss[0], "peak_growth_mb": max(rss) - rss[0]}


RUNNERS = {"mlp": run_mlp, "ranker": run_ranker, "gpt": run_gpt, "memory": run_memory,
           "tel": run_tel}


def run(section: str, mode: str, quick: bool) -> dict:
    """One variant of one sweep in this (fresh) process, with the totals it compiled."""
    common.set_threads()
    import kwker.dynamo as kd
    kd.register()
    torch._dynamo.reset()
    kd.clear_reports()

    def log(msg):
        print(f"[{section}/{mode}] {msg}", file=sys.stderr, flush=True)
    before = counts()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = RUNNERS[section](mode, quick, log)
    totals = delta(before, counts())
    for k, v in out.pop("reference_counts", {}).items():
        totals[k] -= v
    out.update(totals=totals, kernels=kernels(), wall_s=time.perf_counter() - t0)
    return out
