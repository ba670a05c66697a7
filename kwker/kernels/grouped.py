"""``make_grouped_linear``: a mixture of experts' grouped matmul on the GEMM family's kernels.

``torch._grouped_mm(x, w, offs=offs)`` (and transformers' fallback of it, which its MoE layers
call under ``torch.compile`` in float32) multiplies consecutive runs of x's rows by one expert's
weight each: rows ``offs[g - 1]:offs[g]`` by ``w[g]``. The routing decides the runs per call, so
each expert's weight is packed once, at build time, for a kernel generic over the row count
(one compile serves every expert and every run length), and a call walks the runs.

Rows past ``offs[-1]`` (tokens routed nowhere) are zeros, as in transformers' fallback
(``torch._grouped_mm`` leaves them unspecified).
"""
from __future__ import annotations

import torch

from .linear import make_linear


def grouped_linear_aten(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
                        ) -> torch.Tensor:
    """The reference: ``weight`` (E, N, K) in ``nn.Linear``'s layout, run by run on ATen."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], weight[g].t(), out=out[start:end])
        start = end
    return out


def make_grouped_linear(weight: torch.Tensor, dtype: torch.dtype | None = None,
                        source: torch.Tensor | None = None):
    """``callable(x (S, K), offs (E,)) -> (S, N)`` for expert weights ``weight`` (E, N, K)
    (each one ``nn.Linear``'s (N, K)); ``offs``: the cumulative row counts of the runs, int32
    or int64. ``dtype`` (default: the weight's): x's and the output's, float32 or bfloat16.
    ``source``: the parameter ``weight`` views; builds from it share each expert's packed copy
    (``linear.shared``), so another graph or size packs nothing again."""
    if weight.dim() != 3 or min(weight.shape) < 1:
        raise ValueError(f"make_grouped_linear: weight must be (experts, N, K), got "
                         f"{tuple(weight.shape)}")
    dtype = dtype or weight.dtype
    experts, n, k = weight.shape
    linears = [make_linear(weight[g].detach(), None, dtype=dtype, source=source)
               for g in range(experts)]
    name = "kwker grouped linear"

    def run(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != k or x.dtype != dtype:
            raise ValueError(f"{name}: x must be (rows, {k}) {dtype}, got {tuple(x.shape)} "
                             f"{x.dtype}")
        if offs.shape != (experts,) or offs.dtype.is_floating_point:
            raise ValueError(f"{name}: offs must be ({experts},) integers, got "
                             f"{tuple(offs.shape)} {offs.dtype}")
        ends = offs.tolist()
        rows = x.shape[0]
        if any(b < a for a, b in zip([0] + ends, ends)) or (ends and ends[-1] > rows):
            raise RuntimeError(f"{name}: offs {ends} must rise from 0 to at most {rows} rows")
        out = torch.empty(rows, n, dtype=dtype)
        start = 0
        for lin, end in zip(linears, ends):
            if end > start:   # (one copy of each run's result: small beside its product)
                out[start:end] = lin(x[start:end])
            start = end
        if start < rows:
            out[start:].zero_()
        return out

    run.specs = [linears[0].spec]   # one kernel for every expert
    run.linears = linears   # keep the packed weights alive
    return run
