"""The ``torch.compile`` backend ``"kwker"``.

    torch.compile(model, backend="kwker")                              # inner="inductor"
    torch.compile(model, backend="kwker", options={"inner": "eager"})  # seconds to compile

In each FX graph dynamo hands over, GEMMs (with bias, activation and residual epilogues), GELU,
attention (also written out), GEMM+topk and sorting ops become Kwker kernels: specialised to
static sizes, generic over symbolic ones (read per call, so a new size never waits for a
compile). Everything else runs on the inner compiler: plain ATen calls in a flat precomputed
list (``"eager"``), or Inductor, which sees the kernels as opaque custom ops (``"inductor"``;
a graph left with nothing but Kwker kernels and views runs as the flat list there too).
Graphs that need autograd (training) go to the inner compiler unchanged, so gradients are
eager's. Graphs in float32 or bfloat16 are lowered, and so are CPU autocast regions to bfloat16
(see ``lowering/autocast.py``). ``last_report()`` tells which nodes became kernels.

``backend="kwker"`` resolves through the ``torch_dynamo_backends`` entry point without any
import; ``register()`` adds it by name for a source checkout that is not installed.
"""
from __future__ import annotations

import logging

import torch

from .lowering.report import Report, all_reports, clear_reports, last_report, new_graph_id, publish
from .runtime.memory import release_free_heap

log = logging.getLogger("kwker")

OPTIONS = {
    "inner": "compiler for what Kwker does not lower: 'inductor' (default) or 'eager'",
    "dump_dir": "folder receiving each kernel's LLVM IR (.ll, .opt.ll) and assembly (.s)",
}
INNER = ("inductor", "eager")

__all__ = ["Report", "all_reports", "backend", "clear_reports", "last_report", "register"]


def _parse(options: dict | None, kwargs: dict) -> dict:
    opts = dict(options or {})
    opts.update(kwargs)
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        valid = "; ".join(f"{k!r}: {v}" for k, v in OPTIONS.items())
        raise ValueError(f"kwker backend: unknown option(s) {', '.join(map(repr, unknown))}. "
                         f"Valid options are {valid}.")
    inner = opts.setdefault("inner", "inductor")
    if inner not in INNER:
        raise ValueError(f"kwker backend: options['inner'] must be one of {INNER}, "
                         f"not {inner!r}")
    return opts


def _needs_autograd(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether running this graph must record autograd (training, or grad enabled inside)."""
    grad_inputs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in example_inputs)
    if not grad_inputs:
        return False
    if torch.is_grad_enabled():
        return True
    return any(n.op == "call_function" and n.target is torch._C._set_grad_enabled
               for n in gm.graph.nodes)


def _leave_to_inner(gm, example_inputs) -> tuple[str, str] | None:
    """(status, reason) when the whole graph goes to the inner compiler unchanged."""
    if _needs_autograd(gm, example_inputs):
        return "training", "inputs require grad; the inner compiler handles autograd"
    from .lowering.autocast import regions
    why = regions(gm.graph)[1]
    if why is not None:
        return "autocast", why
    return None


def backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None,
            mode: str | None = None, **kwargs):
    """Compile one FX graph from dynamo; returns a callable with the graph's signature."""
    opts = _parse(options, kwargs)
    inner = opts["inner"]
    graph_id = new_graph_id()
    leave = _leave_to_inner(gm, example_inputs)
    if leave is not None:
        publish(Report(graph_id, inner, status=leave[0], reason=leave[1]))
        return _inner(gm, example_inputs, inner, mode)
    from .lowering.decompose import decompose
    original = gm
    gm, decomposed = decompose(gm)
    dump = opts.get("dump_dir")
    try:
        if inner == "eager":
            from .lowering.partition import EagerCompiled
            compiled = EagerCompiled(gm, list(example_inputs), graph_id, inner, dump,
                                     decomposed)
            if compiled.report.status == "lowered" and not compiled.report.kernels:
                # nothing became a kernel (none fits, or ATen measured faster): the graph as
                # dynamo gave it, at exactly the cost of backend="eager"
                return original.forward
            return compiled
        from .lowering.inductor import compile_inductor
        return compile_inductor(gm, list(example_inputs), graph_id, mode, dump, decomposed)
    finally:
        release_free_heap()


def _inner(gm, example_inputs, inner: str, mode: str | None):
    if inner == "eager":
        from .lowering.runner import build_program
        program = build_program(gm)
        return lambda *args: program(args)
    from torch._inductor.compile_fx import compile_fx
    patches = torch._inductor.list_mode_options(mode) if mode else None
    return compile_fx(gm, example_inputs, config_patches=patches)


def register() -> None:
    """Register ``backend="kwker"`` by name (needed only when the entry point is not installed)."""
    from torch._dynamo.backends import registry
    if "kwker" not in registry._COMPILER_FNS:
        registry.register_backend(backend, name="kwker")
