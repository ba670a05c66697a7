"""Kernels + eager ATen calls for ``inner="eager"``: one flat program per graph.

``EagerCompiled`` is what the backend hands back to dynamo, built at compile time. A graph traced
with static shapes gets kernels specialised to them; a graph with symbolic sizes (automatic
dynamic after a second size, ``mark_dynamic``, ``dynamic=True``) gets kernels generic over the
sizes that vary, so no call ever waits for a compile because its size is new. Parameters are
compile-time constants (weights are packed into the
kernels), guarded per call by identity and version counter: an in-place update
(``load_state_dict``, an optimiser step) or another module's parameters reaching the same graph
rebuilds the plan instead of computing with stale weights.
"""
from __future__ import annotations

import logging
from collections import deque

import torch
from torch.fx import GraphModule, Node

from . import build as B
from . import sorting as S
from . import tune
from .autocast import make_explicit
from .chain import chain_kernels
from .fold import fold_constants
from .kv_append import append_matches, attend_appends, build_append
from .make import collecting, discard, generic
from .ops import is_inplace, is_view
from .patterns import Matcher, why_not
from .report import Report, fill, kernel_dtype, publish
from .runner import KernelStep, Program, build_program, fetch_attr
from .shapes import TensorMeta, propagate, propagate_symbolic

log = logging.getLogger("kwker")
MAX_SPARE = 3


def const_nodes(gm: GraphModule, args: list) -> dict:
    """Placeholders bound to parameters, and tensor attributes, that the graph never writes."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, a in zip(placeholders, args):
        if isinstance(a, torch.nn.Parameter) and not _written(n):
            out[n] = a
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            v = fetch_attr(gm, n.target)
            if isinstance(v, torch.Tensor) and not _written(n):
                out[n] = v
    return out


def _written(n: Node) -> bool:
    """Whether an in-place op may write ``n`` or a view of it."""
    seen, todo = {n}, deque([n])
    while todo:
        cur = todo.popleft()
        for u in cur.users:
            if is_inplace(u):
                return True
            if is_view(u) and u not in seen:
                seen.add(u)
                todo.append(u)
    return False


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter
        return None


class Plan:
    __slots__ = ("guards", "program", "report", "subclassed")

    def __init__(self, program: Program, guards: tuple, report: Report):
        self.program, self.guards, self.report = program, guards, report
        # a tensor subclass's _version goes through its __torch_function__ (torchao's weights:
        # ~3 us each, per call; 85 of them in a Llama decode step): read with it disabled
        self.subclassed = any(type(t) not in (torch.Tensor, torch.nn.Parameter)
                              for _, t, _ in guards)

    def valid(self, args) -> bool:
        for i, t, v in self.guards:
            a = args[i]
            if a is not t or (v is not None and a._version != v):
                return False
        return True

    def stale(self, args) -> bool:
        """Its own parameters were updated in place: this plan can never be valid again."""
        return any(args[i] is t and v is not None and t._version != v for i, t, v in self.guards)


def specialise(gm: GraphModule, args: list, graph_id: int, inner: str, note: str = "",
               dump_dir=None, decomposed=(), symbolic: bool = False) -> Plan:
    """Build the flat program for ``args`` (tensors and ints); ``symbolic``: for the sizes
    dynamo traced (its fake inputs), with kernels generic over the symbolic ones."""
    try:
        with collecting(dump_dir) as specs:
            plan = _specialise(gm, args, graph_id, inner, note, decomposed, symbolic)
    except Exception as e:  # a lowering bug must cost speed, never the user's answer
        log.warning("kwker: lowering graph %d failed, it runs on ATen: %s", graph_id, e,
                    exc_info=log.isEnabledFor(logging.DEBUG))
        report = Report(graph_id, inner, status="fallback", reason=f"lowering failed: {e}")
        return Plan(build_program(gm), (), publish(report))
    plan.report.specs = list(dict.fromkeys(specs))
    return plan


def _specialise(gm, args, graph_id, inner, note, decomposed, symbolic) -> Plan:
    report = Report(graph_id, inner, shapes=_shapes_text(args), decomposed=list(decomposed))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = list(gm.graph.nodes)

    def metadata():
        return propagate_symbolic(gm) if symbolic else propagate(gm, args)
    try:
        if fold_constants(gm):  # transformers' masks, computed once here
            nodes = list(gm.graph.nodes)
        metas = metadata()
        if make_explicit(gm, metas):  # autocast's casts as nodes: kernels see its dtypes
            nodes = list(gm.graph.nodes)
            metas = metadata()
    except Exception as e:  # an op fake tensors cannot run: no kernels, no error
        log.debug("kwker: shape propagation failed", exc_info=True)
        report.status, report.reason = "fallback", f"shape propagation failed: {e}"
        fill(report, nodes, [], {})
        return Plan(build_program(gm), (), publish(report))
    consts = const_nodes(gm, args)
    program, used = lower_graph(gm, metas, consts, report)
    index = {n: i for i, n in enumerate(placeholders)}
    guards = tuple((index[n], consts[n], _version(consts[n])) for n in used if n in index)
    if note:
        report.reason = note
    return Plan(program, guards, publish(report))


def lower_graph(gm: GraphModule, metas: dict, consts: dict, report: Report):
    """(flat program, constant nodes its kernels captured): the kernels that fit ``gm`` given
    every node's metadata and the constant tensors, ATen calls for the rest; ``report`` is
    filled in. Shared by the backend and by packages (``kwker.package``)."""
    nodes = list(gm.graph.nodes)
    matches = Matcher(nodes, metas, set(consts), S.module() is not None).run()
    steps, failures, used = [], {}, set()
    native_outputs = set()   # results of kernels a chain may take (lowering/chain.py)

    def laid_out(m, fn):
        """What runs for ``fn``: copied into eager's layout where that differs (a generic
        kernel returns eager's layout itself)."""
        if fn is None or m.kind == "sorting" or not isinstance(metas.get(m.output), TensorMeta) \
                or generic(fn):
            return fn
        return B.restrided(fn, metas[m.output])

    def lower(m) -> None:
        try:
            fn, why = B.build(m, metas, consts)
            inputs = B.runtime_inputs(m)
            runs = laid_out(m, fn)   # a chain takes it only with its native form kept
            chains = getattr(runs, "native", None) is not None and \
                any(x in native_outputs for x in inputs)
            slower, measured = tune.verdict(m, metas, consts, fn, inputs, chains)
            if slower:
                discard(fn)
                fn, why = None, slower
            elif measured:
                report.tuned.append((m.output.name, m.name, measured))
        except Exception as e:  # noqa: BLE001 - a kernel that cannot be built leaves ATen
            log.warning("kwker: building %s for %s failed: %s", m.name, m.output.name, e)
            fn, why = None, f"{type(e).__name__}: {e}"
        if fn is None:
            for c in m.covers:
                failures.setdefault(c, why)
            for f in m.fallback:
                lower(f)
            return
        fn = runs
        if getattr(fn, "native", None) is not None:
            native_outputs.add(m.output)
        steps.append(KernelStep(fn, inputs, m.output, list(m.covers), m.name))
        used.update(v for v in m.inputs.values() if isinstance(v, Node) and v in consts)

    for m in matches:
        lower(m)
    claimed = {c for m in matches for c in m.covers}
    # KV caches: nothing to fit to sizes, nothing to tune
    for m in append_matches(nodes, metas, set(consts), claimed):
        steps.append(KernelStep(build_append(m), [m.inputs["past"], m.inputs["new"]],
                                m.output, m.covers, m.name))
    covered = {c for s in steps for c in s.covers}
    for n in nodes:
        if n not in failures and n not in covered:
            failures[n] = why_not(n, metas)
    program = build_program(gm, chain_kernels(attend_appends(steps, nodes, metas), nodes, metas),
                            metas)
    fill(report, nodes, [(s.name, s.covers, kernel_dtype(s.args, metas), generic(s.fn))
                         for s in steps], failures)
    return program, used


def _shapes_text(args) -> str:
    parts = []
    for a in args:
        if isinstance(a, torch.nn.Parameter):
            continue
        if isinstance(a, torch.Tensor):
            parts.append("x".join(map(str, a.shape)) or "scalar")
        elif isinstance(a, (int, torch.SymInt)):
            parts.append(str(a))
    return ", ".join(parts)


class EagerCompiled:
    """The callable dynamo runs: the plan for the current parameters, run on the inputs."""

    def __init__(self, gm: GraphModule, example_inputs: list, graph_id: int, inner: str,
                 dump_dir=None, decomposed=(), note: str = ""):
        self.gm, self.graph_id, self.inner = gm, graph_id, inner
        self.symbolic = any(isinstance(a, torch.SymInt) for a in example_inputs) or any(
            isinstance(a, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in a.shape)
            for a in example_inputs)
        self.options = {"dump_dir": dump_dir, "decomposed": decomposed,
                        "symbolic": self.symbolic}
        self.spare: list[Plan] = []  # plans for other modules' parameters on the same graph
        self.plan = specialise(gm, list(example_inputs), graph_id, inner, note=note,
                               **self.options)
        self.report = self.plan.report

    def __call__(self, *args):
        plan = self.plan
        if plan.subclassed:
            with torch._C.DisableTorchFunctionSubclass():
                valid = plan.valid(args)
            return plan.program(args) if valid else self._slow(args)
        for i, t, v in plan.guards:  # Plan.valid, inlined: this is the per-call path
            a = args[i]
            if a is not t or (v is not None and a._version != v):
                break
        else:
            return plan.program(args)
        return self._slow(args)

    def _slow(self, args):
        live = [p for p in (self.plan, *self.spare) if not p.stale(args)]
        plan = next((p for p in live if p.valid(args)), None)
        if plan is None:
            plan = specialise(self.gm, list(args), self.graph_id, self.inner,
                              note="parameters changed since compile: re-specialised",
                              **self.options)
            self.report = plan.report
        self.plan, self.spare = plan, [p for p in live if p is not plan][:MAX_SPARE]
        return plan.program(args)
