"""transformers' ``generate()`` with a compiled forward, across architectures: tokens/s and tokens.

What a transformers user writes to speed up generation on a CPU:
``model.forward = torch.compile(model.forward, backend="kwker")``, then ``model.generate(...)``.
Each row is one architecture from transformers' own classes (decoders with multi-head,
grouped-query and multi-query attention, mixtures of experts, encoder-decoders), randomly
initialised at ``--layers`` x ``--width`` with a 32000-token vocabulary; batch 1, a
``--prompt``-token prompt, ``--new`` greedy tokens with the KV cache (prefill + decode steps, so
the decode steps run on dynamic sizes). 2 threads, ``torch.no_grad()``.

- float32: eager, Kwker (default inner) and Inductor (``--no-inductor`` skips it: its first call
  takes 20-40 s a model), each the best of ``--reps`` whole ``generate()`` calls after a first
  one (compile included, reported as "first s"). check: Kwker's tokens equal eager's.
- bfloat16 (``model.to(torch.bfloat16)``): eager and Kwker. Greedy tokens of random models often
  sit near ties, so bf16 tokens are checked against the float32 model's: Kwker's must agree with
  them for at least as many tokens as eager bf16's do (the bf16 contract, read on tokens).

    python benchmarks/bench_generate.py --out benchmarks/results/<cpu>   # generate.{md,json}
    python benchmarks/bench_generate.py --models Llama T5 --dtypes float32
    python benchmarks/bench_generate.py --quick                          # 2 tiny models
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path
from statistics import geometric_mean

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

VOCAB = 32000


def _archs(layers: int, width: int) -> dict:
    """name -> builder of a transformers model at this size (8 heads; 4 key/value heads where
    the architecture groups them)."""
    import transformers as tf
    heads, ffn = 8, 4 * width

    def decoder(cls, cfg, **extra):
        kw = dict(vocab_size=VOCAB, hidden_size=width, intermediate_size=ffn,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4)
        return lambda: getattr(tf, cls)(getattr(tf, cfg)(**{**kw, **extra}))
    return {
        "GPT-2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB)),
        "Llama": decoder("LlamaForCausalLM", "LlamaConfig"),
        "Mistral": decoder("MistralForCausalLM", "MistralConfig"),
        "Qwen2": decoder("Qwen2ForCausalLM", "Qwen2Config"),
        "Qwen3": decoder("Qwen3ForCausalLM", "Qwen3Config", head_dim=64),
        "Phi-3": decoder("Phi3ForCausalLM", "Phi3Config", vocab_size=32064),
        "Gemma 2": decoder("Gemma2ForCausalLM", "Gemma2Config", head_dim=64),
        "Gemma 3": decoder("Gemma3ForCausalLM", "Gemma3TextConfig", head_dim=64),
        "OLMo 2": decoder("Olmo2ForCausalLM", "Olmo2Config"),
        "Granite": decoder("GraniteForCausalLM", "GraniteConfig"),
        "Qwen3-MoE": decoder("Qwen3MoeForCausalLM", "Qwen3MoeConfig", head_dim=64,
                             moe_intermediate_size=width // 2, num_experts=8),
        "Mixtral": decoder("MixtralForCausalLM", "MixtralConfig", intermediate_size=width,
                           num_local_experts=4),
        "OPT": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            num_hidden_layers=layers, hidden_size=width, ffn_dim=ffn, num_attention_heads=heads,
            vocab_size=VOCAB, word_embed_proj_dim=width)),
        "GPT-NeoX": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=ffn,
            num_attention_heads=heads, vocab_size=VOCAB)),
        "Falcon": lambda: tf.FalconForCausalLM(tf.FalconConfig(
            num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
            vocab_size=VOCAB)),
        "BLOOM": lambda: tf.BloomForCausalLM(tf.BloomConfig(
            n_layer=layers, hidden_size=width, n_head=heads, vocab_size=VOCAB)),
        "GPTBigCode": lambda: tf.GPTBigCodeForCausalLM(tf.GPTBigCodeConfig(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB)),
        "CodeGen": lambda: tf.CodeGenForCausalLM(tf.CodeGenConfig(
            n_layer=layers, n_embd=width, n_head=heads, vocab_size=VOCAB, rotary_dim=32)),
        "T5": lambda: tf.T5ForConditionalGeneration(tf.T5Config(
            num_layers=layers, d_model=width, d_ff=ffn, num_heads=heads, vocab_size=VOCAB,
            decoder_start_token_id=0)),
        "BART": lambda: tf.BartForConditionalGeneration(tf.BartConfig(
            encoder_layers=layers, decoder_layers=layers, d_model=width, encoder_ffn_dim=ffn,
            decoder_ffn_dim=ffn, encoder_attention_heads=heads, decoder_attention_heads=heads,
            vocab_size=VOCAB)),
    }


def first_difference(a: torch.Tensor, b: torch.Tensor, new: int) -> int:
    """How many of the ``new`` generated tokens two generations share before they part."""
    diff = (a[0, -new:] != b[0, -new:]).nonzero()
    return int(diff[0]) if len(diff) else new


def timed(model, forward, prompt, new: int, reps: int) -> tuple[torch.Tensor, float, float]:
    """(tokens, first call s, best of ``reps`` later calls s) of ``generate`` with ``forward``."""
    eager_forward = model.forward
    model.forward = forward
    try:
        with torch.no_grad():
            args = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                        eos_token_id=None)
            t0 = time.perf_counter()
            tokens = model.generate(prompt, **args)
            first, best = time.perf_counter() - t0, float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                again = model.generate(prompt, **args)
                best = min(best, time.perf_counter() - t0)
                if not torch.equal(again, tokens):
                    raise AssertionError("generate() gave other tokens on a later call")
    finally:
        model.forward = eager_forward
    return tokens, first, best


def _lowered(reports) -> str:
    kernels = sum(len(r.kernels) for r in reports)
    fell = [r.reason for r in reports if r.status != "lowered"]
    return f"{kernels} kernels in {len(reports)} graphs" + (f", {len(fell)} fell back" if fell
                                                            else "")


def seeded(build, args) -> tuple[torch.nn.Module, torch.Tensor]:
    """(the float32 model, the prompt), the same in every row of a model."""
    torch.manual_seed(0)
    model = build().eval()
    torch.manual_seed(1)
    return model, torch.randint(3, VOCAB, (1, args.prompt))


def measure(name: str, build, dtype: str, args, f32_tokens=None) -> tuple[dict, torch.Tensor]:
    """(one row: eager, Kwker (and Inductor in float32) generating from the same prompt;
    eager's tokens)."""
    import kwker.dynamo as kd
    model, prompt = seeded(build, args)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    row = {"model": name, "dtype": dtype, "s": {}, "first_s": {}}
    expected, row["first_s"]["eager"], row["s"]["eager"] = timed(
        model, model.forward, prompt, args.new, args.reps)
    backends = ["kwker"] + (["inductor"] if dtype == "float32" and args.inductor else [])
    for backend in backends:
        torch._dynamo.reset()
        kd.clear_reports()
        tokens, row["first_s"][backend], row["s"][backend] = timed(
            model, torch.compile(model.forward, backend=backend), prompt, args.new, args.reps)
        if backend == "kwker":
            kwker_tokens, row["lowered"] = tokens, _lowered(kd.all_reports())
    torch._dynamo.reset()
    row["ratio"] = row["s"]["eager"] / row["s"]["kwker"]
    if dtype == "float32":
        same = first_difference(kwker_tokens, expected, args.new)
        row["check"] = "ok" if same == args.new else f"tokens differ from new token {same}"
    else:
        eager_agrees = first_difference(expected, f32_tokens, args.new)
        kwker_agrees = first_difference(kwker_tokens, f32_tokens, args.new)
        row["agrees_with_f32"] = {"eager": eager_agrees, "kwker": kwker_agrees}
        row["check"] = "ok" if kwker_agrees >= eager_agrees else "agrees with float32 less"
    new = args.new
    print(f"{name:<11} {dtype:<8} " + "  ".join(
        f"{b} {new / row['s'][b]:.1f} tok/s" for b in row["s"])
        + f"  eager/Kwker {row['ratio']:.2f}x  {row['check']}  {row['lowered']}", flush=True)
    return row, expected


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for dtype in ("float32", "bfloat16"):
        of = [r for r in rows if r["dtype"] == dtype]
        if not of:
            continue
        geo = geometric_mean(r["ratio"] for r in of)
        least = min(of, key=lambda r: r["ratio"])
        text = (f"{dtype}: Kwker {geo:.2f}x eager as a geomean over {len(of)} models, least "
                f"{least['ratio']:.2f}x ({least['model']})")
        vs_inductor = [r["s"]["inductor"] / r["s"]["kwker"] for r in of if "inductor" in r["s"]]
        if vs_inductor:
            text += f"; Inductor / Kwker {geometric_mean(vs_inductor):.2f}x as a geomean"
        bad = [r["model"] for r in of if r["check"] != "ok"]
        lines.append(text + (f"; check failed: {', '.join(bad)}" if bad else "; every check ok")
                     + ".")
    return lines


def table(rows: list[dict], new: int) -> str:
    def tps(r, b):
        return f"{new / r['s'][b]:.1f}" if b in r["s"] else "-"

    def first(r):
        return " / ".join(f"{r['first_s'][b]:.1f}" for b in ("kwker", "inductor")
                          if b in r["first_s"])
    return common.md_table(
        ["model", "dtype", "eager tok/s", "Inductor tok/s", "Kwker tok/s", "eager / Kwker",
         "Inductor / Kwker", "first call s (Kwker / Inductor)", "check", "Kwker lowered"],
        [[r["model"], r["dtype"], tps(r, "eager"), tps(r, "inductor"), tps(r, "kwker"),
          f"**{r['ratio']:.2f}x**",
          f"{r['s']['inductor'] / r['s']['kwker']:.2f}x" if "inductor" in r["s"] else "-",
          first(r), r["check"] + (" (tokens agreeing with float32's: eager {eager}, Kwker "
                                  "{kwker})".format(**r["agrees_with_f32"])
                                  if "agrees_with_f32" in r else ""), r["lowered"]]
         for r in rows])


def render(rows: list[dict], info: dict, args) -> str:
    return "\n".join([
        "# transformers generate() with a compiled forward", "", common.machine_line(info), "",
        (f"{args.layers} layers x {args.width} wide, random weights, batch 1, a {args.prompt}-"
         f"token prompt, {args.new} greedy tokens with the KV cache; tok/s = new tokens / the "
         "whole generate() call (prefill included), best of "
         f"{args.reps} after a first call; ratio = eager s / Kwker s. `model.forward = "
         "torch.compile(model.forward, backend=...)`, default inner. check: float32, tokens "
         "equal eager's; bf16, tokens agree with the float32 model's for at least as long as "
         "eager bf16's do."), "", *summary(rows), "", table(rows, args.new), ""]) + "\n"


def headline(rows: list[dict]) -> list[dict]:
    out = []
    for dtype in ("float32", "bfloat16"):
        of = [r for r in rows if r["dtype"] == dtype]
        if of:
            out.append({"label": f"generate() {dtype}, geomean vs eager over {len(of)} models",
                        "ratio": geometric_mean(r["ratio"] for r in of)})
            least = min(of, key=lambda r: r["ratio"])
            out.append({"label": f"generate() {dtype}, least: {least['model']}",
                        "ratio": least["ratio"], "target": 1.0})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 models, 2 layers; results files only with --out")
    ap.add_argument("--models", nargs="+", default=None, help="names from the table (default all)")
    ap.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"),
                    default=["float32", "bfloat16"])
    ap.add_argument("--no-inductor", dest="inductor", action="store_false")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.new, args.reps = 2, 128, 6, 1
        args.models = args.models or ["Llama", "T5"]
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    transformers.logging.set_verbosity_error()
    common.set_threads()
    info = common.machine_info()
    archs = _archs(args.layers, args.width)
    names = args.models or list(archs)
    unknown = set(names) - set(archs)
    if unknown:
        ap.error(f"unknown models {sorted(unknown)}; choose from {list(archs)}")
    rows = []
    for name in names:
        if "float32" in args.dtypes:
            row, reference = measure(name, archs[name], "float32", args)
            rows.append(row)
        else:   # the float32 model's tokens, untimed
            model, prompt = seeded(archs[name], args)
            reference = timed(model, model.forward, prompt, args.new, 0)[0]
        if "bfloat16" in args.dtypes:
            rows.append(measure(name, archs[name], "bfloat16", args, reference)[0])
    text = render(rows, info, args)
    print(text)
    if not args.quick or args.out:
        out = args.out or common.RESULTS
        (out / "generate.md").parent.mkdir(parents=True, exist_ok=True)
        (out / "generate.md").write_text(text)
        common.write_json(out / "generate.json", {"script": "bench_generate.py", "machine": info,
                                                   "rows": rows, "headline": headline(rows)})
    return 1 if any(r["check"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
