"""Run by test_other_isa.py in a subprocess whose target is overridden (KWKER_CPU/FEATURES):
every factory on that ISA, compared with torch. Prints one line per check, exits 1 on failure."""
import sys

import torch
import torch.nn.functional as F

from kwker.kernels import blocking
from kwker.kernels.eltwise import make_gelu
from kwker.kernels.linear import make_linear
from kwker.kernels.matmul import make_matmul
from kwker.kernels.sdpa import make_sdpa
from kwker.kernels.topk import make_linear_topk
from kwker.runtime.target import host_target


def close(a, b, tol=1e-4):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    checks = {}
    for m, n, k, epi in [(1, 37, 70, "gelu"), (5, 100, 33, "relu"), (50, 61, 130, "gelu_tanh")]:
        w, b, x = torch.randn(n, k) / k ** 0.5, torch.randn(n), torch.randn(m, k)
        ref = F.linear(x, w, b)
        ref = {"gelu": F.gelu, "relu": torch.relu,
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[epi](ref)
        checks[f"linear {m}x{n}x{k} {epi}"] = close(make_linear(w, b, m, epi)(x), ref)
    a, bt = torch.randn(2, 30, 40), torch.randn(2, 50, 40)
    checks["matmul nk"] = close(make_matmul(30, 40, 50, 2, True)(a, bt), a @ bt.transpose(1, 2))
    x = torch.randn(5000) * 3
    checks["gelu"] = close(make_gelu(5000)(x), F.gelu(x))
    q, kk, v = torch.randn(2, 2, 70, 24), torch.randn(2, 2, 90, 24), torch.randn(2, 2, 90, 24)
    for causal in (False, True):
        y = make_sdpa(2, 2, 70, 90, 24, 24, causal)(q, kk, v)
        checks[f"sdpa causal={causal}"] = close(
            y, F.scaled_dot_product_attention(q, kk, v, is_causal=causal))
    w = torch.randint(-2, 3, (2000, 16)).float()
    x = torch.randint(-2, 3, (9, 16)).float()
    vals, idx = make_linear_topk(w, 9, 20)(x)
    rv, ri = torch.topk(x @ w.t(), 20)
    checks["linear_topk ties"] = torch.equal(idx, ri) and torch.equal(vals, rv)
    print(f"target {host_target().describe()} lanes {blocking.lanes()}")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
