"""Decoding with low-bit weights: GPT-2 and a Llama at batch 1, tokens/s against the roofline.

The models are transformers' GPT-2 (its default config: 12 layers, 768 wide, 50257-token
vocabulary, 124M parameters; its ``Conv1D`` layers as the ``nn.Linear`` torchao quantises, same
arithmetic) and a Llama of about that size (``config``: grouped-query attention, SwiGLU MLP,
RMSNorm), randomly initialised. Each row generates greedily with the KV cache from a 128-token
prompt: the prompt's forward (prefill) is timed alone, then 64 new tokens (decode tokens/s), best
of ``--reps`` runs. Rows, one model each, in one process:

- eager float32 and bf16 (``model.to(torch.bfloat16)``);
- torchao weight-only int8 (``Int8WeightOnlyConfig``) and int4 (``IntxWeightOnlyConfig``,
  groups of 32), eager and under Inductor (``torch.compile``, the default backend);
- the same quantised models under ``backend="kwker"`` (inner eager), float32 and bf16
  activations;
- Kwker and Inductor again with torch's ``guard_filter_fn=skip_guard_on_all_nn_modules_unsafe``
  ("module guards skipped"): a token is a few ms, and dynamo checks ~3000 guards on the model's
  modules (their hook dicts, config attributes) before each call. Safe where the serving code does
  not change the modules after compiling; Kwker still checks each parameter's identity and version.
- Kwker packages (decode_package.py): the prompt's forward and a decode step exported
  (``torch.export``), packaged (``kwker.package``) and loaded, generating with no dynamo in the
  loop; "first call" includes exporting and packaging.
- Kwker again under ``torch.set_float32_matmul_precision("medium")`` (bf16 products allowed
  for float32 matmuls, as eager's oneDNN reads it): the prefill's int8 products take two byte
  planes of x instead of three, int4's bf16 products where the CPU has ``vdpbf16ps``.

Roofline: the bytes of every linear weight in its format (values, scales, zero points) read once
per token, against the bandwidth of a streaming read of a buffer that size on huge pages
(``probes.read_gbps``, measured in the same run). ``check`` says whether a Kwker row's 64 tokens
equal eager torchao's on the same quantised model. Targets (issue 20): int8 >= 2x eager bf16,
int4 >= 3x, both >= 2x eager torchao and >= 1.5x torchao under Inductor, >= 75% of the roofline;
prefill no slower than eager bf16.

    python benchmarks/bench_decode.py --out benchmarks/results/<cpu>  # decode[_llama].{md,json,png}
    python benchmarks/bench_decode.py --models llama    # one model
    python benchmarks/bench_decode.py --quick    # 2-layer models, 8 tokens, prints only
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import probes
from decode_package import Packaged
from model_defs import llama_config

from kwker.runtime.memory import release_free_heap

PROMPT, NEW = 128, 64
# (label, activation dtype, quantisation, how it runs). Inductor's rows come last: on the Zen 5
# VM the two rows after them ran at half speed (GPT-2 int8 prefill 128-131 ms against 69-81
# without them or after a 60 s pause), with nothing of the run busy in between
ROWS = [
    ("eager float32", "f32", None, "eager"),
    ("eager bf16", "bf16", None, "eager"),
    ("torchao int8, eager", "f32", "int8", "eager"),
    ("torchao int4, eager", "f32", "int4", "eager"),
    ("Kwker int8", "f32", "int8", "kwker"),
    ("Kwker int4", "f32", "int4", "kwker"),
    ("Kwker bf16 + int8", "bf16", "int8", "kwker"),
    ("Kwker bf16 + int4", "bf16", "int4", "kwker"),
    ("Kwker int8, module guards skipped", "f32", "int8", "kwker-lean"),
    ("Kwker int4, module guards skipped", "f32", "int4", "kwker-lean"),
    ("Kwker int8, float32 matmul precision medium", "f32", "int8", "kwker-medium"),
    ("Kwker int4, float32 matmul precision medium", "f32", "int4", "kwker-medium"),
    ("Kwker package int8", "f32", "int8", "package"),
    ("Kwker package int4", "f32", "int4", "package"),
    ("torchao int8, Inductor", "f32", "int8", "inductor"),
    ("torchao int4, Inductor", "f32", "int4", "inductor"),
    ("torchao int8, Inductor, module guards skipped", "f32", "int8", "inductor-lean"),
    ("torchao int4, Inductor, module guards skipped", "f32", "int4", "inductor-lean"),
]


MODELS = ("gpt2", "llama")
KWKER_HOWS = ("kwker", "package")   # the rows that run Kwker's kernels


def config(model: str, quick: bool):
    """transformers' GPT-2 (its defaults), or a Llama of about its size (llama_config)."""
    import transformers as tf
    if model == "llama":
        return llama_config(256, 2, 4096) if quick else llama_config()
    if quick:
        return tf.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=512)
    return tf.GPT2Config(n_positions=1024)


def describe(cfg) -> dict:
    return {"name": cfg.model_type, "layers": cfg.num_hidden_layers, "width": cfg.hidden_size,
            "vocab": cfg.vocab_size}


def linearize(model) -> None:
    """GPT-2's ``Conv1D`` (``x @ W + b`` with W stored (in, out)) as ``nn.Linear``."""
    from transformers.pytorch_utils import Conv1D
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                lin = torch.nn.Linear(child.weight.shape[0], child.nf, dtype=child.weight.dtype)
                with torch.no_grad():
                    lin.weight.copy_(child.weight.t())
                    lin.bias.copy_(child.bias)
                setattr(module, name, lin)


def quantize(model, quant: str) -> None:
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    quantize_(model, Int8WeightOnlyConfig() if quant == "int8" else
              IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))


def build(cfg, dtype: str, quant: str | None, how: str):
    import transformers as tf
    torch.manual_seed(0)
    if cfg.model_type == "llama":
        model = tf.LlamaForCausalLM(cfg).eval()
    else:
        model = tf.GPT2LMHeadModel(cfg).eval()
        linearize(model)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    if quant:
        quantize(model, quant)
    lean = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} \
        if how.endswith("-lean") else {}
    if how.startswith("kwker"):
        return model, torch.compile(model, backend="kwker", options={"inner": "eager", **lean})
    if how.startswith("inductor"):
        return model, torch.compile(model, options=lean or None)
    if how == "package":
        return model, Packaged.build(model, PROMPT)
    return model, model


def weight_bytes(shapes: list, dtype: str, quant: str | None) -> int:
    """Bytes of the linear weights (``shapes``: their (N, K)) a token reads, as the row stores
    them."""
    total = 0
    for n, k in shapes:
        if quant == "int8":
            total += n * k + n * 4                       # values, a float32 scale per row
        elif quant == "int4":
            total += n * k // 2 + n * (k // 32) * 4      # two values a byte, a scale per 32
        else:
            total += n * k * (2 if dtype == "bf16" else 4)
    return total


def linear_shapes(cfg) -> list:
    model = build(cfg, "f32", None, "eager")[0]
    return [tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def generate(model, prompt, steps: int):
    """(tokens, prefill seconds, decode tokens/s) of a greedy run with the KV cache."""
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)
        tokens = [out.logits[:, -1:].argmax(-1)]
        t1 = time.perf_counter()
        for _ in range(steps - 1):
            out = model(input_ids=tokens[-1], past_key_values=out.past_key_values, use_cache=True)
            tokens.append(out.logits[:, -1:].argmax(-1))
        t2 = time.perf_counter()
    return torch.cat(tokens, 1), t1 - t0, (steps - 1) / (t2 - t1)


def run(model_name: str, quick: bool, reps: int) -> tuple[list[dict], dict]:
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    cfg = config(model_name, quick)
    shapes = linear_shapes(cfg)
    steps = 8 if quick else NEW
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT))
    eager_tokens, rows, bandwidth = {}, [], {}
    for label, dtype, quant, how in ROWS:
        if quick and how.startswith("inductor"):
            continue
        torch._dynamo.reset()
        torch.set_float32_matmul_precision("medium" if how.endswith("-medium") else "highest")
        t = time.perf_counter()
        _, model = build(cfg, dtype, quant, how)
        packaging = time.perf_counter() - t if how == "package" else 0.0  # export, package, load
        gc.collect()
        release_free_heap()  # what earlier rows and the quantisation freed leaves the RSS
        rss = common.rss_mb()
        t = time.perf_counter()
        generate(model, prompt, 4)                   # compiles (prefill and decode graphs)
        first = time.perf_counter() - t + packaging
        gc.collect()
        rss = common.rss_mb() - rss
        best_prefill, best_tps = float("inf"), 0.0
        for _ in range(reps):
            tokens, prefill, tps = generate(model, prompt, steps)
            best_prefill, best_tps = min(best_prefill, prefill), max(best_tps, tps)
        nbytes = weight_bytes(shapes, dtype, quant)
        if nbytes not in bandwidth:
            bandwidth[nbytes] = probes.read_gbps(torch.get_num_threads(), nbytes, 1, 5)
        gbps = best_tps * nbytes / 1e9
        key = (dtype, quant)
        if how == "eager":
            eager_tokens[key] = tokens
        check = ""
        if how.startswith(KWKER_HOWS):
            reference = eager_tokens.get(key)
            if reference is None:  # bf16 + quantised has no eager row: build it once here
                reference = generate(build(cfg, dtype, quant, "eager")[1], prompt, steps)[0]
            differ = (tokens != reference).nonzero()
            check = "same tokens" if not len(differ) else \
                f"differs from token {int(differ[0, 1])}" + (
                    " (bf16 roundings)" if dtype == "bf16" or how.endswith("-medium") else "")
        if how == "package":
            check += f"; package {model.nbytes / 1e6:.0f} MB"
        row = {"row": label, "dtype": dtype, "weights": quant or dtype, "how": how,
               "tok_s": best_tps, "prefill_ms": best_prefill * 1e3, "first_s": first,
               "rss_mb": rss,
               "weight_mb": nbytes / 1e6, "gbps": gbps, "stream_gbps": bandwidth[nbytes],
               "roofline": gbps / bandwidth[nbytes], "check": check}
        print(f"{label:<24} {best_tps:6.1f} tok/s  prefill {best_prefill * 1e3:6.1f} ms  "
              f"{gbps:5.1f} GB/s of {bandwidth[nbytes]:.1f} ({row['roofline']:.0%})  "
              f"first call {first:.1f} s  RSS +{rss:.0f} MB  {check}", flush=True)
        rows.append(row)
    torch.set_float32_matmul_precision("highest")
    return rows, {**describe(cfg),
                  "prompt": PROMPT, "new_tokens": steps}


def _get(rows, label):
    return next((r for r in rows if r["row"] == label), None)


def ratios(rows: list[dict]) -> list[list]:
    """Each Kwker row against eager bf16, eager torchao and torchao + Inductor of its format
    (with module guards skipped too, for a row that skips them)."""
    bf16 = _get(rows, "eager bf16")
    out = []
    for r in rows:
        if not r["how"].startswith(KWKER_HOWS):
            continue
        q, lean = r["weights"], ", module guards skipped" if r["how"].endswith("-lean") else ""
        ao, ind = _get(rows, f"torchao {q}, eager"), _get(rows, f"torchao {q}, Inductor{lean}")

        def ratio(base, r=r):
            return f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        prefill = f"{bf16['prefill_ms'] / r['prefill_ms']:.2f}x" if bf16 else "-"
        out.append([r["row"], ratio(bf16), ratio(ao), ratio(ind), f"{r['roofline']:.0%}",
                    prefill, r["check"]])
    return out


def headline(rows: list[dict]) -> list[dict]:
    bf16, out = _get(rows, "eager bf16"), []
    for quant, target in (("int8", 2.0), ("int4", 3.0)):
        r = _get(rows, f"Kwker {quant}")
        if bf16 and r:
            out.append({"label": f"{quant} decode vs eager bf16",
                        "ratio": r["tok_s"] / bf16["tok_s"], "target": target})
    return out


def render(rows: list[dict], model: dict, info: dict) -> str:
    title = {"gpt2": "GPT-2", "llama": "a Llama-style model"}.get(model["name"], model["name"])
    lines = [(f"# Decoding {title} with low-bit weights ({model['layers']} layers, "
              f"{model['width']} wide, vocabulary {model['vocab']}; prompt {model['prompt']}, "
              f"{model['new_tokens']} greedy tokens, batch 1)"), "", common.machine_line(info), "",
             ("tok/s: decode tokens per second (best run); prefill: the prompt's forward; GB/s: "
             "linear-weight bytes per token x tok/s; roofline: that against a streaming read of "
             "as many bytes on 2 MB pages, measured in the same run (stream GB/s). Targets "
             "(issue 20): int8 >= 2x eager bf16, int4 >= 3x; both >= 2x eager torchao, "
             ">= 1.5x torchao + Inductor, >= 75% of the roofline; prefill no slower than eager "
             "bf16. RSS +MB: growth of the resident set over the first call (compile, "
             "prefill, 3 tokens), from after the model was built (heap freed before that "
             "returned to the OS); target: <= 1.3x the packed weights plus activations."), ""]
    lines.append(common.md_table(
        ["row", "tok/s", "prefill ms", "weights MB", "GB/s", "stream GB/s", "roofline",
         "first call s", "RSS +MB", "check"],
        [[r["row"], f"{r['tok_s']:.1f}", f"{r['prefill_ms']:.1f}", f"{r['weight_mb']:.0f}",
          f"{r['gbps']:.1f}", f"{r['stream_gbps']:.1f}", f"{r['roofline']:.0%}",
          f"{r['first_s']:.1f}", f"{r['rss_mb']:.0f}" if "rss_mb" in r else "",
          r["check"]] for r in rows]))
    lines += ["", ("Kwker's decode against the alternatives (tok/s ratios), and its prefill "
                   "against eager bf16's:"), ""]
    lines.append(common.md_table(["Kwker row", "vs eager bf16", "vs eager torchao",
                                  "vs torchao + Inductor", "roofline", "prefill vs bf16",
                                  "check"], ratios(rows)))
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, info: dict) -> bool:
    plt = common.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(rows) + 1))
    colors = ["tab:orange" if r["how"].startswith(KWKER_HOWS) else "tab:grey" for r in rows]
    ys = list(range(len(rows)))[::-1]
    ax.barh(ys, [r["tok_s"] for r in rows], color=colors)
    for y, r in zip(ys, rows):
        ax.text(r["tok_s"] * 1.01, y, f"{r['tok_s']:.1f} ({r['roofline']:.0%} of roofline)",
                va="center", fontsize=7)
    ax.set_yticks(ys, [r["row"] for r in rows], fontsize=8)
    ax.set_xlabel("decode tokens/s (batch 1)", fontsize=8)
    ax.set_xlim(right=max(r["tok_s"] for r in rows) * 1.45)
    return common.save_plot(fig, path, f"{path.stem}: {info['cpu']}, {info['threads']} threads")


def main_over_models(argv, doc: str, script: str, stem: str, run, render, headline=None,
                     plot=None) -> int:
    """The decode scripts' command line (this one and decode_breakdown.py): each model of
    ``--models`` run, its table printed and written as ``<stem>.md`` / ``.json`` (GPT-2) or
    ``<stem>_<model>`` (the others), with ``plot`` a ``.png`` beside them."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    common.set_threads()
    info = common.machine_info()
    for name in args.models:
        rows, model = run(name, args.quick, 1 if args.quick else args.reps)
        text = render(rows, model, info)
        print(text)
        if args.quick:
            continue
        out = args.out or common.RESULTS
        path = out / (stem if name == "gpt2" else f"{stem}_{name}")
        data = {"script": script, "machine": info, "model": model, "rows": rows}
        if headline is not None:
            data["headline"] = headline(rows)
        common.write_json(path.with_suffix(".json"), data)
        path.with_suffix(".md").write_text(text)
        if plot is not None:
            plot(rows, path.with_suffix(".png"), info)
    return 0


def main(argv=None) -> int:
    return main_over_models(argv, __doc__, "bench_decode.py", "decode", run, render, headline,
                            plot)


if __name__ == "__main__":
    sys.exit(main())
