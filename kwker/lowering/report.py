"""Which graph nodes became Kwker kernels and which ran on the inner compiler, and why.

One ``Report`` per compiled graph (with symbolic sizes too: one report, its kernels marked
generic); the last one is ``kwker.dynamo.last_report()``. Each report is also logged as one
line under the ``kwker`` logger, so ``logging.getLogger("kwker").setLevel(logging.INFO)``
shows what a compile did.
"""
from __future__ import annotations

import logging
import operator
import threading
from collections import Counter
from dataclasses import dataclass, field

from torch.fx import Node

from ..kernels.specs import instruction_path
from ..runtime import tile_permission
from ..runtime.target import host_target
from .ops import canon

log = logging.getLogger("kwker")

# Node kinds Kwker has kernels for: finding one on the inner compiler is a "miss" worth reporting.
LOWERABLE = {"linear", "matmul", "mm", "bmm", "addmm", "gelu", "sdpa", "layer_norm", "topk",
             "sort", "argsort", "msort", "kthvalue", "mode", "median", "nanmedian", "quantile",
             "nanquantile", "grouped_mm"}
_FUSED_TARGETS = {"_transformer_encoder_layer_fwd", "multi_head_attention_forward",
                  "_native_multi_head_attention"}


@dataclass
class Report:
    graph: int
    inner: str
    status: str = "lowered"      # lowered | training | autocast | fallback
    reason: str = ""
    shapes: str = ""
    # (kernel name, [node names], dtype, "generic" | "specialised"): a generic kernel reads the
    # sizes that vary (rows, batch, sequence lengths) at call time; a specialised one has every
    # size compiled in
    kernels: list = field(default_factory=list)
    inner_nodes: list = field(default_factory=list)  # (node name, op)
    missed: list = field(default_factory=list)       # (node name, op, reason)
    decomposed: list = field(default_factory=list)   # (node name, op) expanded into primitives
    notes: list = field(default_factory=list)        # (node name, why a bigger fusion failed)
    specs: list = field(default_factory=list)        # kernel specs built for this graph
    tuned: list = field(default_factory=list)        # (node, kernel, measured against ATen)

    @property
    def kernel_names(self) -> list[str]:
        return [k[0] for k in self.kernels]

    @property
    def kernel_dtypes(self) -> list[str]:
        """The dtype each kernel runs in ("float32", "bfloat16"), in ``kernels`` order."""
        return [k[2] for k in self.kernels]

    @property
    def kernel_sizes(self) -> list[str]:
        """"generic" or "specialised" per kernel, in ``kernels`` order."""
        return [k[3] for k in self.kernels]

    @property
    def kernel_paths(self) -> dict[str, str]:
        """Kernel symbol -> the instructions it runs on here (amx, avx512-bf16, avx512, avx2)."""
        target = host_target()
        return {spec.symbol: instruction_path(spec, target) for spec in self.specs}

    def _paths_text(self) -> str:
        counts = Counter(self.kernel_paths.values())
        return ", ".join(f"{path} {n}" for path, n in sorted(counts.items()))

    @property
    def kwker_nodes(self) -> list[str]:
        return [n for k in self.kernels for n in k[1]]

    def summary(self) -> str:
        where = f" [{self.shapes}]" if self.shapes else ""
        head = f"kwker graph {self.graph}{where}: "
        if self.status != "lowered":
            return head + f"{self.status} ({self.reason}); every node runs on {self.inner}"
        kinds = ", ".join(n if d == "float32" else f"{n} {d}"
                          for n, _, d, _ in self.kernels) or "none"
        generic = sum(k[3] == "generic" for k in self.kernels)
        kinds += f"; {generic} generic over sizes" if generic else ""
        miss = f"; missed {len(self.missed)}" if self.missed else ""
        paths = f"; on {self._paths_text()}" if self.specs else ""
        return (head + f"{len(self.kernels)} Kwker kernels ({kinds}) covering "
                f"{len(self.kwker_nodes)} nodes; {len(self.inner_nodes)} nodes on "
                f"{self.inner}{miss}{paths}")

    def __str__(self) -> str:
        lines = [self.summary()]
        lines += [f"  kwker  {k:<22} {d:<9} {g:<11} {', '.join(n)}"
                  for k, n, d, g in self.kernels]
        lines += [f"  {self.inner:<6} {n:<22} {op}" for n, op in self.inner_nodes]
        lines += [f"  missed {n:<22} {op}: {why}" for n, op, why in self.missed]
        lines += [f"  split  {n:<22} {op}" for n, op in self.decomposed]
        lines += [f"  note   {n:<22} {why}" for n, why in self.notes]
        lines += [f"  tuned  {k:<22} {n}: {text}" for n, k, text in self.tuned]
        lines += [f"  path   {path:<22} {symbol}" for symbol, path in self.kernel_paths.items()]
        refusal = tile_permission.refusal()
        if refusal:
            lines.append(f"  tiles  off: {refusal}")
        return "\n".join(lines)


def describe(node: Node) -> str:
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def fill(report: Report, nodes: list, kernels: list, failures: dict) -> None:
    """Sort ``nodes`` into kernels and inner nodes; ``failures``: node -> why its match failed.

    ``kernels`` is a list of (kernel name, covered nodes, torch dtype it runs in, whether it is
    generic over the sizes that vary).
    """
    covered = set()
    for name, cov, dtype, is_generic in kernels:
        report.kernels.append((name, [c.name for c in cov], str(dtype).replace("torch.", ""),
                               "generic" if is_generic else "specialised"))
        covered.update(cov)
    report.notes += [(n.name, why) for n, why in failures.items() if n in covered]
    for n in nodes:
        if n.op not in ("call_function", "call_method") or n in covered:
            continue
        if n.target is operator.getitem and n.args and n.args[0] in covered:
            continue  # unpacking a kernel's (values, indices): structure, not work
        report.inner_nodes.append((n.name, describe(n)))
        target = getattr(n.target, "__name__", n.target if isinstance(n.target, str) else "")
        if canon(n) in LOWERABLE or target in _FUSED_TARGETS:
            report.missed.append((n.name, describe(n), failures.get(n, "no pattern applies")))


def kernel_dtype(inputs: list, metas: dict):
    """The dtype a kernel runs in: that of its first floating input."""
    for n in inputs:
        m = metas.get(n)
        dtype = getattr(m, "dtype", None)
        if dtype is not None and dtype.is_floating_point:
            return dtype
    return "float32"


_lock = threading.Lock()
_reports: list[Report] = []
_next_graph = [0]


def new_graph_id() -> int:
    with _lock:
        _next_graph[0] += 1
        return _next_graph[0]


def publish(report: Report) -> Report:
    with _lock:
        _reports.append(report)
        del _reports[:-256]
    log.info("%s", report.summary())
    return report


def last_report() -> Report | None:
    """The report of the most recent compile or specialisation in this process."""
    with _lock:
        return _reports[-1] if _reports else None


def all_reports() -> list[Report]:
    with _lock:
        return list(_reports)


def clear_reports() -> None:
    with _lock:
        _reports.clear()
