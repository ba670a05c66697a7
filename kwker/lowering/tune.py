"""ATen is always a candidate: a lowered kernel is kept only where it measures faster.

For a match with static sizes, the kernel Kwker built and the nodes it would replace (run as
ATen runs them, node by node) are timed on this machine, on random inputs of the match's
shapes, dtypes and strides. If ATen wins, the nodes stay on the inner compiler and the report
says by how much. The verdict is recorded (``runtime/tuning.py``) with the CPU's identity, so
each problem is measured once per machine type, thread count and Kwker version; later processes,
prewarmed caches and packages reuse it. Not measured here: matches with dynamic sizes, the
sorting ops (whose ``run`` already takes ATen's kernel below its measured thresholds), and a
static size the generic kernel stands in for (build.py's no-stall rule: a size dynamo gives a
graph of its own after a dynamic one, as it does for 1), unless a record of it exists: measuring
would stall the very call the stand-in serves at once (the tutorial Ranker's first batch-1 call
after other sizes took 390 ms, 290 of them timing three matches).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule, Node

from ..kernels._call import float32_precision
from ..runtime import tuning
from .grouped import even_runs
from .shapes import TensorMeta

log = logging.getLogger("kwker")

# A kernel's time alone, as the tuner judges it against ATen's: times MARGIN_FACTOR (timing
# noise) plus MARGIN_US, or MARGIN_SHARE of its time if that is less (in a graph a kernel may pay
# more per call than its timing alone sees: its Python wrapper around the ctypes call, against
# ATen's one C call). Measured 2026-12-03: a 17 us bmm kernel 1.03x ATen alone ran at 0.82x the
# same graph on ATen (Zen 3), a 17 us linear 1.01x ATen alone at 0.94x (Emerald Rapids); a 5 us
# linear 1.98x ATen alone ran at 1.34x, a 4 us LayerNorm 1.63x ATen alone took 7-10 us a call
# in a decode step against ATen's 14-15, and a 1.4 ms linear 1.08x ATen alone is worth keeping.
# So ATen keeps the near-ties, and a short kernel must win by a quarter.
# A kernel that will run inside a chain (``chains``: it has a native form and reads another
# such kernel's result, lowering/chain.py) pays no Python wrapper there, while ATen's calls in
# its place would break the chain in two, each part a step of its own: there the margin is
# ATen's to win by. (A Llama decode step's SwiGLU of 672 values, 2.93 us alone against ATen's
# 2.78, stayed on ATen and split each layer's chain in three, two ATen steps between.) Where
# the run does not form after all (something between the two that a chain cannot pass), such a
# kernel may run up to that margin slower than ATen.
MARGIN_FACTOR, MARGIN_US, MARGIN_SHARE = 1.03, 3.0, 0.25
MARGIN = (MARGIN_FACTOR, MARGIN_US, MARGIN_SHARE)


@functools.cache
def method() -> str:
    """How verdicts are measured: a hash of this file and of the kernels' wrappers (build.py,
    build_attention.py, make.py), part of each problem's key, so a change to any of them
    measures the problems again."""
    here, h = Path(__file__).resolve().parent, hashlib.sha256()
    for name in ("tune.py", "build.py", "build_attention.py", "make.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:12]


def _describe(v) -> object:
    """A plain, stable description of a parameter, metadata or constant (for the problem key)."""
    if isinstance(v, TensorMeta):
        return ["tensor", list(v.shape), list(v.stride), str(v.dtype)]
    if isinstance(v, torch.Tensor):
        plain = ["const", list(v.shape), list(v.stride()), str(v.dtype)]
        flatten = getattr(v, "__tensor_flatten__", None)
        if type(v) in (torch.Tensor, torch.nn.Parameter) or flatten is None:
            return plain
        names, attrs = flatten()  # a tensor subclass (torchao's quantised weights): its format
        return plain + [type(v).__name__, list(names), _describe(attrs)]
    if isinstance(v, (list, tuple)):
        return [_describe(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _describe(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def _op_name(n: Node) -> str:
    if n.op == "call_method":
        return "method." + n.target
    t = n.target
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', getattr(t, '__name__', t))}"


def problem(m, metas: dict, consts: dict, inputs: list) -> str | None:
    """The match as a key: what it computes, from which ops, at which sizes; None when a size
    is not static (nothing to time)."""
    described = []
    for n in inputs:
        meta = metas.get(n)
        if not isinstance(meta, TensorMeta) or not all(type(s) is int for s in meta.shape) \
                or not all(type(s) is int for s in meta.stride):
            return None
        described.append(_describe(meta))
    params = {k: (_describe(metas.get(v)) if isinstance(v, Node) else _describe(v))
              for k, v in m.params.items()}
    const_inputs = {k: _describe(consts[v]) for k, v in m.inputs.items()
                    if isinstance(v, Node) and v in consts}
    flags = {k: v for k, v in m.inputs.items() if not isinstance(v, Node)}
    # ATen's float32 matmuls change with torch's precision setting (under "medium": oneDNN for
    # MKL on Zen 5, bf16 products on AMX): a verdict holds for the setting it was measured under
    return json.dumps({"kind": m.name, "method": method(),
                       "float32_precision": float32_precision(),
                       "ops": [_op_name(c) for c in m.covers],
                       "inputs": described, "consts": const_inputs, "flags": _describe(flags),
                       "params": params}, sort_keys=True)


def _random(meta: TensorMeta) -> torch.Tensor:
    """A tensor of ``meta``'s shape, strides and dtype with values in [0, 1) (a valid quantile q,
    a mask that keeps most keys)."""
    span = 1 + sum((s - 1) * st for s, st in zip(meta.shape, meta.stride) if s > 0)
    if meta.dtype == torch.bool:
        base = torch.rand(span) > 0.1
    elif meta.dtype.is_floating_point:
        base = torch.rand(span).to(meta.dtype)
    else:
        base = torch.zeros(span, dtype=meta.dtype)
    return base.as_strided(meta.shape, meta.stride)


def _sample(m, metas: dict, n: Node) -> torch.Tensor:
    """A random input of the match's, or a valid one where random values mean nothing (the
    runs of a grouped matmul)."""
    if m.kind == "grouped_mm" and n is m.inputs["offs"]:
        return even_runs(metas[n], metas[m.inputs["x"]].shape[0])
    return _random(metas[n])


def reference(m, metas: dict, consts: dict, inputs: list):
    """``callable(*inputs)`` running the match's nodes as ATen does, or None when a node
    reads a value that is neither an input, a constant nor a static size.

    The nodes are copied into a graph of their own and run as the Python code FX generates for
    it: one direct call per op, as a compiled graph makes them. (Walking the nodes with
    ``map_arg`` cost 3-5 us a call, which a small op's ATen time then carried: a bmm of 17 us
    measured 1.18x slower on ATen than its kernel, and ran level with it in the graph.)"""
    covered = set(m.covers)
    if m.output not in covered or any(c.op not in ("call_function", "call_method")
                                      for c in m.covers):
        return None
    graph, holder = Graph(), torch.nn.Module()
    env = {n: graph.placeholder(f"in{i}") for i, n in enumerate(inputs)}
    for c in m.covers:
        for a in c.all_input_nodes:
            if a in covered or a in env:
                continue
            if a in consts:
                name = f"const{len(env)}"
                setattr(holder, name, consts[a])
                env[a] = graph.get_attr(name)
            elif isinstance(metas.get(a), (bool, int, float)):
                env[a] = metas[a]
            else:
                return None
    for c in _in_graph_order(m.covers, covered):
        env[c] = graph.node_copy(c, env.__getitem__)
    graph.output(env[m.output])
    return GraphModule(holder, graph).forward


def _in_graph_order(nodes, covered: set) -> list:
    """``nodes`` with each after the covered nodes it reads: a match lists its nodes as its
    pattern found them (under autocast a weight's cast comes before the transpose it casts)."""
    order, seen = [], set()

    def visit(n):
        if n in seen:
            return
        seen.add(n)
        for a in n.all_input_nodes:
            if a in covered:
                visit(a)
        order.append(n)
    for n in nodes:
        visit(n)
    return order


def verdict(m, metas: dict, consts: dict, fn, inputs: list,
            chains: bool = False) -> tuple[str | None, str]:
    """(why the nodes stay on ATen, or None to keep the kernel ``fn`` taking ``inputs``;
    the measurement in words for the report, "" when nothing was measured). ``chains``: the
    kernel will run inside a chain (ATen then carries the margin)."""
    if fn is None or m.kind == "sorting" or not m.covers or not tuning.measuring():
        return None, ""
    key = problem(m, metas, consts, inputs)
    if key is None:
        return None, ""
    ref = reference(m, metas, consts, inputs)
    if ref is None:
        return None, ""
    try:
        record, _ = tuning.decide(key, m.name, {"kwker": lambda: fn, "aten": lambda: ref},
                                  lambda: [_sample(m, metas, n) for n in inputs],
                                  handicap={"aten" if chains else "kwker": MARGIN},
                                  measure=not getattr(fn, "kwker_stand_in", False))
    except Exception as e:  # noqa: BLE001 - a failed measurement keeps the built kernel
        log.debug("kwker: timing %s failed: %s", m.name, e)
        return None, ""
    if record is None:   # a stand-in without a record: not measured (module doc)
        return None, ""
    times = record.get("times_us", {})
    kw, at = times.get("kwker"), times.get("aten")
    if not (kw and at):
        return None, ""
    measured = f"{at:g} us on ATen, {kw:g} on Kwker"
    if record.get("choice") == "aten":
        if kw < at:
            return (f"the kernel is only {at / kw:.2f}x ATen on this CPU, less than it must "
                    f"win by ({MARGIN_FACTOR - 1:.0%} and {MARGIN_US:g} us a call, or "
                    f"{MARGIN_SHARE:.0%} on a short call; "
                    f"{measured})"), measured
        return f"ATen {kw / at:.2f}x faster on this CPU ({measured})", measured
    return None, f"{at / kw:.2f}x ATen ({measured})"
