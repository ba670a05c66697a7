"""``make_matmul``: products of two runtime tensors (mm, bmm, matmul), optionally ``a @ b.T``."""
from __future__ import annotations

import torch

from . import blocking
from ._call import _profiler_enabled, checked, entry, record_function
from .specs import GemmSpec


def make_matmul(m: int, k: int, n: int, batch: int = 1, b_transposed: bool = False):
    """``callable(a (batch, m, k), b (batch, k, n)) -> (batch, m, n)``.

    With ``b_transposed`` the second operand is ``(batch, n, k)`` and the result is ``a @ b.T``
    (packed into panels per call). 2-D operands are accepted when ``batch == 1``.
    """
    m, k, n, batch = int(m), int(k), int(n), int(batch)
    if min(m, k, n, batch) < 1:
        raise ValueError(f"make_matmul: empty shapes m={m}, k={k}, n={n}, batch={batch}")
    layout = "nk" if b_transposed else "kn"
    blk = blocking.choose(m, n, k, b_layout=layout)
    spec = GemmSpec(m, n, k, batch, layout, **blk.as_kwargs())
    fn = entry(spec, 5)
    symbol = spec.symbol
    a_shape = (batch, m, k)
    b_shape = (batch, n, k) if b_transposed else (batch, k, n)
    out_shape = (batch, m, n)
    f32, empty, threads = torch.float32, torch.empty, torch.get_num_threads

    def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        two_d = a.dim() == 2
        if not (a.shape == a_shape and a.dtype == f32 and a.is_contiguous()):
            a = checked(a.unsqueeze(0) if two_d and batch == 1 else a, a_shape, "matmul a")
        if not (b.shape == b_shape and b.dtype == f32 and b.is_contiguous()):
            b = checked(b.unsqueeze(0) if b.dim() == 2 and batch == 1 else b, b_shape,
                        "matmul b")
        out = empty(out_shape, dtype=f32)
        if _profiler_enabled():
            with record_function(symbol):
                fn(a.data_ptr(), b.data_ptr(), None, None, out.data_ptr(), threads())
        else:
            fn(a.data_ptr(), b.data_ptr(), None, None, out.data_ptr(), threads())
        return out[0] if two_d else out

    run.spec = spec
    return run
