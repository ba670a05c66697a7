"""The tutorial (shared/tutorial.md), step by step: run it to see each step's output.

    python examples/tutorial.py
"""
import time

import torch

import kwker.torch_ops as kto

# ------------------------------------------------------------------------ Step 1: the model
torch.manual_seed(0)


class Ranker(torch.nn.Module):
    def __init__(self, n_items=20_000, dim=128):
        super().__init__()
        self.query = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                                         torch.nn.Linear(256, dim))
        self.items = torch.nn.Parameter(torch.randn(n_items, dim) / dim**0.5)

    def forward(self, x):
        scores = self.query(x) @ self.items.t()
        return torch.topk(scores, 10, dim=-1)


model = Ranker().eval()
x = torch.randn(32, 64)
with torch.no_grad():
    best_scores, best_items = model(x)
print(best_items.shape)

# ----------------------------------------------------------------- Step 2: drop-in kernels
with kto.accelerated(), torch.no_grad():
    scores2, items2 = model(x)
print(torch.equal(scores2, best_scores), torch.equal(items2, best_items))

# ------------------------------------------------------- Step 3: the torch.compile backend
compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
with torch.no_grad():
    scores3, items3 = compiled(x)
print(torch.allclose(scores3, best_scores, rtol=1e-4, atol=1e-5))
print((items3 == best_items).float().mean().item() > 0.99)


# -------------------------------------------------------- Step 4: time it on your machine
def best_ms(fn, reps=20):
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


with torch.no_grad():
    print(f"PyTorch:            {best_ms(lambda: model(x)):.2f} ms")
    with kto.accelerated():
        print(f"drop-in kernels:    {best_ms(lambda: model(x)):.2f} ms")
    print(f"torch.compile:      {best_ms(lambda: compiled(x)):.2f} ms")
