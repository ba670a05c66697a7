"""``inner="inductor"``: matched nodes become ``torch.ops.kwker.*`` calls, Inductor does the rest.

The rewrite works on dynamo's graph with dynamo's fake tensors, so it holds for symbolic sizes
too. Kernels are built (or loaded) here, at compile time: specialised to the graph's sizes when
they are static, generic over the symbolic ones otherwise (the custom ops read those at call
time, and their fakes keep them symbolic: no recompile per size). The report says which fit.
"""
from __future__ import annotations

import copy
import logging
import math

import torch
from torch.fx import GraphModule
from torch.fx.node import map_arg

from ..kernels.linear_lowbit import is_quantized
from . import build as B
from . import custom_ops as C
from . import make, tune
from . import sorting as S
from .autocast import make_explicit
from .build_attention import with_casts
from .fold import fold_constants
from .generic import SHORT_NAMES, SIZED_INPUTS, generic_shapes
from .ops import is_view
from .partition import EagerCompiled, const_nodes
from .patterns import Match, Matcher, why_not
from .report import Report, fill, kernel_dtype, publish
from .shapes import is_concrete, propagate_symbolic

log = logging.getLogger("kwker")


def _call_args(m: Match) -> tuple:
    i, p = m.inputs, m.params
    if m.kind == "linear":
        return i["x"], i["weight"], i["bias"], i["residual"], p["epilogue"], i["transposed"]
    if m.kind == "linear_topk":
        return i["x"], i["weight"], i["transposed"], p["k"], p["largest"]
    if m.kind == "matmul":
        return i["a"], i["b"]
    if m.kind == "gelu":
        return i["x"], p["approximate"]
    if m.kind == "silu_mul":
        return i["x"], i["y"]
    if m.kind == "rope":
        return i["x"], i["cos"], i["sin"]
    if m.kind == "grouped_mm":
        return i["x"], i["weight"], i["offs"], i["transposed"]
    if m.kind == "sdpa":
        return i["q"], i["k"], i["v"], i["mask"], p["causal"], p["scale"], \
            p.get("written", False), None if p.get("fill", -math.inf) == -math.inf else p["fill"]
    if m.kind == "layer_norm":
        return i["x"], i["weight"], i["bias"], p["d"], p["eps"], p["norm"], p.get("out"), \
            p.get("offset", 0.0)
    return (i["x"], *p["args"])


def _prebuild(m: Match, metas: dict, consts: dict, specs: list,
              report: Report) -> tuple[str | None, bool]:
    """Build the match's kernel now: (why it does not fit or stays on ATen, or None; whether
    it is generic)."""
    i, p = m.inputs, m.params
    if m.kind == "rope":  # one kernel for every size, built at the op's first call
        return None, True
    if m.kind not in SIZED_INPUTS:
        return None, False   # sorting ops: generic over sizes already (kwker.ops)
    keys, short = SIZED_INPUTS[m.kind], SHORT_NAMES
    shapes = {k: metas[i[k]].shape if i.get(k) is not None else None for k in keys}
    generic = not all(is_concrete(metas[i[k]]) for k in keys if i.get(k) is not None)
    if generic:
        g = generic_shapes(m.kind, {short.get(k, k): v for k, v in shapes.items()})
        shapes = {k: g[short.get(k, k)] for k in keys}
    dtype = metas[i[keys[0]]].dtype
    if m.kind == "linear":
        bias = consts[i["bias"]] if i["bias"] is not None else None
        res = i["residual"]
        fn, why = C.linear_kernel(shapes["x"], consts[i["weight"]], bias, shapes["residual"],
                                  p["epilogue"], i["transposed"], dtype,
                                  res_dtype=metas[res].dtype if res is not None else None)
    elif m.kind == "linear_topk":
        fn, why = C.linear_topk_kernel(shapes["x"], consts[i["weight"]], i["transposed"],
                                       p["k"], p["largest"], dtype)
    elif m.kind == "matmul":
        bt = generic and B.transposed_view(metas[i["b"]])
        fn, why = C.matmul_kernel(shapes["a"], shapes["b"], dtype, b_transposed=bt)
    elif m.kind == "gelu":
        n = None if generic else math.prod(shapes["x"])
        fn, why = C.gelu_kernel(n, p["approximate"], dtype)
    elif m.kind == "silu_mul":
        fn, why = C.silu_mul_kernel(None if generic else math.prod(shapes["x"]), dtype)
    elif m.kind == "grouped_mm":
        fn, why = C.grouped_mm_kernel(consts[i["weight"]], i["transposed"], dtype)
    elif m.kind == "layer_norm":
        w, b = (consts[i[k]] if i[k] is not None else None for k in ("weight", "bias"))
        fn, why = C.layer_norm_kernel(shapes["x"], w, b, p["eps"], dtype, norm=p["norm"],
                                      out_dtype=p.get("out"), offset=p.get("offset", 0.0))
    else:  # the layouts q, k, v arrive in (heads side by side...), as the op's call looks up
        strides = tuple(tuple(metas[i[k]].stride) for k in ("q", "k", "v"))
        fn, why = C.sdpa_kernel(shapes["q"], shapes["k"], shapes["v"], shapes["mask"],
                                p["mask"], p["causal"], p["scale"], strides, dtype=dtype,
                                written=p.get("written", False),
                                fill=p.get("fill", -math.inf))
    if m.kind == "sdpa":   # the op is called with k and v cast (_rewrite), the match's before
        fn = with_casts(fn, p.get("casts"))
    if fn is not None and not generic:
        slower, measured = tune.verdict(m, metas, consts, fn, B.runtime_inputs(m))
        if slower:
            return slower, False
        if measured:
            report.tuned.append((m.output.name, m.name, measured))
    specs.extend(getattr(fn, "kwker_specs", ()))
    return (None if fn is not None else why), make.generic(fn)


def compile_inductor(gm: GraphModule, example_inputs: list, graph_id: int, mode: str | None,
                     dump_dir=None, decomposed=()):
    patches = {}
    if mode:  # a bad mode is an error whatever the graph holds (Inductor imported for it only)
        from torch._inductor import list_mode_options
        patches = list_mode_options(mode)
    try:
        lowered = GraphModule(gm, copy.deepcopy(gm.graph))
        report = _rewrite(lowered, example_inputs, graph_id, dump_dir, decomposed)
        left = _work_left(lowered)
        if report.kernels and any(is_quantized(t) for t in example_inputs):
            # AOTAutograd hands torchao's weight subclasses to Kwker's ops as they are, and
            # the subclass refuses ops it does not know (seen on GPT-2): a flat program runs
            # the same kernels, and torchao's own code for anything left
            return EagerCompiled(gm, list(example_inputs), graph_id, "inductor", dump_dir,
                                 decomposed, note="torchao weights: run as a flat program")
        if report.kernels and left is not None:
            # nothing Inductor could fuse: it would only add its call wrappers (~30 us per call
            # on the tutorial Ranker) and seconds of compile per graph; the flat program runs
            # the same kernels
            return EagerCompiled(gm, list(example_inputs), graph_id, "inductor", dump_dir,
                                 decomposed, note=f"{left}: run as a flat program, nothing "
                                 "for Inductor to fuse")
        publish(report)
    except Exception as e:  # a lowering bug must cost speed, never the user's answer
        log.warning("kwker: lowering graph %d failed, Inductor compiles it alone: %s", graph_id,
                    e, exc_info=log.isEnabledFor(logging.DEBUG))
        publish(Report(graph_id, "inductor", status="fallback", reason=f"lowering failed: {e}"))
        return _compile_fx(gm, example_inputs, patches)
    # dynamo's guards check the inputs and Kwker's ops return what their fakes say: Inductor's
    # own size and alignment asserts would re-check both on every call (~0.3 us each)
    return _compile_fx(lowered, example_inputs,
                       {**patches, "size_asserts": False, "alignment_asserts": False})


def _compile_fx(gm: GraphModule, example_inputs: list, patches: dict):
    """Inductor on ``gm``, imported only here: a graph left with nothing for Inductor (the
    flat program above) does not pay its import (~0.5-1 s of a warm compile)."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, example_inputs, config_patches=patches or None)


# no work Inductor could fuse: entering/leaving autocast, grad mode
_CONTEXT = {"_enter_autocast", "_exit_autocast", "_set_grad_enabled"}
# ops that only move or make data: Inductor's code for them is the same copies ATen's is
_GLUE = {"cat", "stack", "embedding", "arange", "clone", "contiguous", "zeros", "ones", "full",
         "empty", "zeros_like", "ones_like", "full_like", "empty_like", "index_select"}
# other ops left beside the kernels that are still not worth Inductor's compile (a decoder's
# embedding sum): fused, they would save at most a pass or two over their operands
MAX_LOOSE_OPS = 2


def _work_left(gm: GraphModule) -> str | None:
    """What the rewritten graph leaves besides Kwker ops, views, size arithmetic and data
    movement, when that is at most MAX_LOOSE_OPS other ops (nothing Inductor could fuse much),
    else None. Measured on the GPT decoder (bench_dynamic.py; its layer norms on Kwker, embeddings
    and KV-cache concatenations left): its first generation costs 6.4 s of compiles instead of
    21 s, and tokens/s is no lower."""
    loose = glue = 0
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
                n.target.namespace == "kwker":
            continue
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if is_view(n) or name in _CONTEXT:
            continue
        if n.op == "call_method" and name in ("size", "dim", "stride"):
            continue
        tensor = isinstance(n.meta.get("example_value"), torch.Tensor)
        if n.op == "call_function" and getattr(n.target, "__module__", "") in (
                "_operator", "operator") and not tensor:
            continue  # size arithmetic
        if name in _GLUE:
            glue += 1
            continue
        loose += 1
        if loose > MAX_LOOSE_OPS:
            return None
    if not loose and not glue:
        return "only Kwker kernels and views"
    return f"{loose} other and {glue} data-movement ops besides the Kwker kernels"


def _rewrite(gm: GraphModule, example_inputs: list, graph_id: int, dump_dir,
             decomposed) -> Report:
    """Replace matched nodes of ``gm`` (in place) by Kwker custom ops; returns the report, for
    the caller to publish (a graph that runs as the flat program publishes its own)."""
    report = Report(graph_id, "inductor", decomposed=list(decomposed))
    nodes = list(gm.graph.nodes)
    try:
        if fold_constants(gm):  # transformers' masks, computed once here
            nodes = list(gm.graph.nodes)
        metas = propagate_symbolic(gm)
        if make_explicit(gm, metas):  # autocast's casts as nodes: kernels see its dtypes
            nodes = list(gm.graph.nodes)
            metas = propagate_symbolic(gm)
    except Exception as e:  # an op fake tensors cannot run: Inductor alone, no error
        log.debug("kwker: symbolic propagation failed", exc_info=True)
        report.status, report.reason = "fallback", f"shape propagation failed: {e}"
        return report
    consts = const_nodes(gm, example_inputs)
    matches = Matcher(nodes, metas, set(consts), S.module() is not None).run()
    failures, kept, generic = {}, [], set()

    def lower(m) -> None:
        try:
            why, is_generic = _prebuild(m, metas, consts, specs, report)
        except Exception as e:  # noqa: BLE001 - one kernel that cannot be built leaves Inductor
            log.warning("kwker: building %s for %s failed: %s", m.name, m.output.name, e)
            why, is_generic = f"{type(e).__name__}: {e}", False
        if why is None:
            kept.append(m)
            if is_generic:
                generic.add(m.output)
            return
        for c in m.covers:
            failures.setdefault(c, why)
        for f in m.fallback:
            lower(f)

    with make.collecting(dump_dir) as specs:
        for m in matches:
            lower(m)
    report.specs = list(dict.fromkeys(specs))
    covered = {c for m in kept for c in m.covers}
    for n in nodes:
        if n not in failures and n not in covered:
            failures[n] = why_not(n, metas)
    fill(report, nodes, [(m.name, m.covers, kernel_dtype(B.runtime_inputs(m), metas),
                          m.output in generic) for m in kept], failures)
    graph = gm.graph
    replaced = {}  # outputs of earlier kernels -> their custom-op nodes
    for m in kept:
        target = C.op(m.params["variant"] if m.kind == "sorting" else m.kind)
        args = map_arg(_call_args(m), lambda n: replaced.get(n, n))
        with graph.inserting_before(m.output):
            if m.kind == "sdpa" and m.params.get("casts"):   # autocast's, on unrepeated heads
                args = tuple(graph.call_method("to", (a, m.params["casts"][k]))
                             if k in m.params["casts"] else a
                             for k, a in zip(("q", "k", "v"), args[:3])) + args[3:]
            new = graph.call_function(target, args)
        new.meta.update(m.output.meta)
        m.output.replace_all_uses_with(new)
        replaced[m.output] = new
        for c in reversed(m.covers):
            if not c.users:
                graph.erase_node(c)
    graph.lint()
    gm.recompile()
    return report
