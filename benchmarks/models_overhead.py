"""Per-call overhead of a model compiled with Kwker (inner=eager), split into Kwker's own share
and dynamo's, for bench_models.py (the tutorial model; target below ``OVERHEAD_TARGET_US``)."""
from __future__ import annotations

import time

import torch

import common
from model_defs import build

OVERHEAD_TARGET_US = 20.0  # issue 4: per-call cost over the kernels, tutorial model, inner=eager


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
            times = common.best_of_rounds(sides, reps, rounds)
            us.update({s.name: t * 1e6 for s, t in zip(sides, times)})
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


OVERHEAD_METHOD = (
    "What a call costs beyond the kernels: Kwker's share (its step list, slot "
    "handling, the non-kernel ATen calls such as unpacking a tuple) and dynamo's "
    "(frame evaluation and guards), which every `torch.compile` backend pays. "
    "Best of interleaved samples. The directly timed rows run that code alone, "
    "with warm caches and idle threads; the differences also include what it "
    "costs to run it right after the kernels (caches emptied by their data, the "
    "OpenMP workers still spinning, which matters on a loaded machine) and are "
    "noisy to a few µs.")
