"""Where a decode token's time goes under Kwker: the GEMVs the roofline counts, and the rest.

bench_decode.py measures tokens/s against the roofline (the linear weights' bytes read once a
token, at the speed of a streaming read). This splits one token of its Kwker rows (float32
activations, int8 and int4 weights; compiled with ``inner="eager"``, and packaged) by timing
every step of Kwker's program (lowering/runner.py) as it runs: the low-bit linears, attention
(which reads the KV cache, bytes the roofline does not count), the KV cache appends, the norms,
other kernels and the program's other steps (views, embedding). "Outside the program" is the
rest of the model call: compiled, dynamo's frame and guards and the model's Python outside the
captured graph, which any ``torch.compile`` backend pays; packaged, the input checks and the
output's structure. The clock's own cost is the difference between the token's time untimed and
the timed model call, both reported. Beside the roofline's read (one buffer of the weights'
bytes) and the memory's own speed, a plain read of buffers of the linears' sizes, one call each
in the token's order, says what the weights' streams give as laid out, each starting cold.

    python benchmarks/decode_breakdown.py --out benchmarks/results/<cpu>  # .md and .json
    python benchmarks/decode_breakdown.py --models llama   # decode_breakdown_llama.md only
    python benchmarks/decode_breakdown.py --quick    # 2-layer models, prints only
"""
from __future__ import annotations

import sys
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import probes
from bench_decode import (
    PROMPT,
    build,
    config,
    describe,
    linear_shapes,
    main_over_models,
    weight_bytes,
)

from kwker.lowering.runner import Program

# a kernel step's pattern name (KernelStep.name) -> its group: the first whose word it holds
# (a decoder's KV appends are inside attention's step where one step does both: sdpa_kv_append;
# the norms between two attentions inside the step that chains them to the linears)
LINEARS = "linears, with the norms chained to them (low-bit: the roofline's bytes)"
GROUPS = (("chain", LINEARS), ("linear", LINEARS), ("sdpa", "attention"),
          ("kv_append", "KV cache appends"), ("norm", "norms"), ("", "other kernels"))
OTHER_STEPS = "other program steps (views, embedding, ...)"
# bench_decode's ways of running the model -> what runs outside Kwker's program there
HOWS = {"kwker": "compiled", "package": "packaged"}
OUTSIDE = {"kwker": "dynamo frame and guards, model code outside the graph",
           "package": "the package's input checks and output structure, the adapter"}
ROOFLINE_TARGET = 0.75   # issue 20
MEMORY_PROBE = 1 << 30   # bytes: a read well past any L3, the memory's own speed


def group_of(step) -> str:
    name = getattr(step, "kernel", None)
    return OTHER_STEPS if name is None else next(g for word, g in GROUPS if word in name)


@contextmanager
def step_clock(into: dict):
    """Every Kwker program called inside runs with each step timed: ``into[group]`` gains its
    seconds, ``into["program"]`` each call's. The program runs as ever (its own ``__call__``),
    its steps wrapped in a clock the first time it is called here and restored on leaving."""
    plain = Program.__call__
    clock = time.perf_counter
    own_steps = {}   # program -> its steps before the clocks

    def clocked(step, group: str):
        def run(env):
            t = clock()
            step(env)
            into[group] += clock() - t
        return run

    def timed(self, args):
        if self not in own_steps:
            own_steps[self] = self.steps
            self.steps = [(clocked(step, group_of(step)), dead) for step, dead in self.steps]
        start = clock()
        out = plain(self, args)
        into["program"] += clock() - start
        return out

    Program.__call__ = timed
    try:
        yield
    finally:
        Program.__call__ = plain
        for program, steps in own_steps.items():
            program.steps = steps


def decode(model, prompt, steps: int, into: dict | None) -> float:
    """Seconds per decoded token (greedy, KV cache) after the prompt's forward; with ``into``,
    the decode steps' program parts added to it (seconds over all tokens) and ``into["call"]``
    the model calls'."""
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        total = 0.0
        with nullcontext() if into is None else step_clock(into):
            for _ in range(steps):
                t = time.perf_counter()
                out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
                total += time.perf_counter() - t
                token = out.logits[:, -1:].argmax(-1)
    if into is not None:
        into["call"] += total
    return total / steps


def run(model_name: str, quick: bool, reps: int) -> tuple[list[dict], dict]:
    warnings.filterwarnings("ignore")
    cfg = config(model_name, quick)
    steps = 8 if quick else 64
    prompt = torch.randint(0, cfg.vocab_size, (1, PROMPT))
    rows = []
    for how, quant in ((h, q) for h in HOWS for q in ("int8", "int4")):
        torch._dynamo.reset()
        _, model = build(cfg, "f32", quant, how)
        decode(model, prompt, 4, None)                       # compiles
        plain = min(decode(model, prompt, steps, None) for _ in range(reps))
        best = None
        for _ in range(reps):                                # the least disturbed timed run
            parts = defaultdict(float)
            decode(model, prompt, steps, parts)
            if best is None or parts["call"] < best["call"]:
                best = parts
        shapes = linear_shapes(cfg)
        nbytes = weight_bytes(shapes, "f32", quant)
        threads = torch.get_num_threads()
        gbps = probes.read_gbps(threads, nbytes, 1, 5)
        each = probes.read_each_gbps(threads, [weight_bytes([s], "f32", quant) for s in shapes])
        memory = probes.read_gbps(threads, MEMORY_PROBE, 1, 3)
        per_token = {k: v / steps * 1e3 for k, v in best.items()}        # ms
        rows.append({"how": how, "weights": quant, "token_ms": plain * 1e3,
                     "parts_ms": per_token,
                     "weight_mb": nbytes / 1e6, "stream_gbps": gbps,
                     "stream_ms": nbytes / gbps / 1e6, "memory_gbps": memory,
                     "each_gbps": each})
        print(f"{HOWS[how]}, {quant}: {plain * 1e3:.2f} ms a token untimed, "
              f"{per_token['call']:.2f} timed (program {per_token['program']:.2f}); weights at "
              f"the stream's speed {rows[-1]['stream_ms']:.2f} ms", flush=True)
    return rows, {**describe(cfg), "new_tokens": steps}


def linear_gbps(row: dict) -> float:
    """The low-bit linears' weight bytes over their time in the model (GB/s)."""
    ms = row["parts_ms"].get(GROUPS[0][1], 0.0)
    return row["weight_mb"] / ms if ms else 0.0


def table_rows(row: dict) -> list[list]:
    """(part, ms a token, share of the timed call) for one weight format."""
    p = row["parts_ms"]
    call = p["call"]
    order = [g for _, g in GROUPS if g in p] + [OTHER_STEPS]
    parts = [(f"outside Kwker's program ({OUTSIDE[row.get('how', 'kwker')]})",
              call - p["program"])]
    parts += [(f"program: {g}", p[g]) for g in dict.fromkeys(order) if g in p]
    out = [[name, f"{ms:.3f}", f"{ms / call:.0%}"] for name, ms in parts]
    out.append(["the model call (timed)", f"{call:.3f}", "100%"])
    return out


def render(rows: list[dict], model: dict, info: dict) -> str:
    lines = [(f"# Where a decode token's time goes under Kwker ({model['name']}, "
              f"{model['layers']} layers, {model['width']} wide; float32 activations, "
              f"batch 1; compiled with inner=eager, and packaged)"), "",
             common.machine_line(info), "",
             (f"Each step of Kwker's program timed as it runs, over {model['new_tokens']} "
              f"greedy tokens after a {PROMPT}-token prompt (the timed run least disturbed of "
              "several); ms a token. The roofline budget: the linear weights' bytes at the "
              "speed of a streaming read of as many bytes (on 2 MB pages), measured in the "
              "same run (best of "
              "a few passes, so the caches hold what they can); issue 20's target is 75% of "
              "the roofline, i.e. a whole token within budget / 0.75. The memory's own speed, "
              "a read of 1 GB, is given beside it: the linears' GB/s in the model (their "
              "bytes over their time) against both says where their weights came from."), ""]
    for row in rows:
        budget = row["stream_ms"]
        lines += [f"## {HOWS[row.get('how', 'kwker')]}, {row['weights']} weights "
                  f"({row['weight_mb']:.0f} MB)", "",
                  (f"Token untimed {row['token_ms']:.2f} ms; the weights at "
                   f"{row['stream_gbps']:.1f} GB/s take {budget:.2f} ms: 75% of the roofline "
                   f"is a token in {budget / ROOFLINE_TARGET:.2f} ms (now "
                   f"{budget / row['token_ms']:.0%}). In the model the linears read their "
                   f"weights at {linear_gbps(row):.1f} GB/s; the memory's own speed is "
                   f"{row['memory_gbps']:.1f} GB/s"
                   + (f", and a plain read of buffers of the linears' sizes, one call each in "
                      f"the token's order, {row['each_gbps']:.1f} GB/s" if "each_gbps" in row
                      else "") + "."), ""]
        lines.append(common.md_table(["part", "ms a token", "share"], table_rows(row)))
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    return main_over_models(argv, __doc__, "decode_breakdown.py", "decode_breakdown", run,
                            render)


if __name__ == "__main__":
    sys.exit(main())
