"""Kernels under unusual thread setups: odd team sizes, and concurrent calls from Python threads
(each call owns its argument block and scratch; ctypes releases the GIL)."""
import threading

import pytest
import torch
import torch.nn.functional as F

from kwker.kernels import make_linear, make_linear_topk, make_matmul, make_sdpa


@pytest.mark.parametrize("nthreads", [3, 5])
def test_odd_team_sizes(nthreads):
    torch.set_num_threads(nthreads)
    torch.manual_seed(nthreads)
    for m, n, k in [(1, 4096, 64), (37, 300, 70), (5, 20000, 32)]:
        w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(m, k)
        torch.testing.assert_close(make_linear(w, b, m, "gelu")(x), F.gelu(F.linear(x, w, b)),
                                   rtol=1e-4, atol=1e-4)
        a, bt = torch.randn(3, m, k), torch.randn(3, n, k)
        torch.testing.assert_close(make_matmul(m, k, n, 3, True)(a, bt), a @ bt.transpose(1, 2),
                                   rtol=1e-4, atol=1e-4)
    w = torch.randint(-2, 3, (3000, 40)).float()
    x = torch.randint(-2, 3, (3, 40)).float()
    for screen in (False, None):
        _, i = make_linear_topk(w, 3, 30, True, screen=screen)(x)
        assert torch.equal(i, torch.topk(x @ w.t(), 30).indices)


@pytest.mark.parametrize("nthreads", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_split_by_work_shares_panels(nthreads, dtype):
    """Pre-packed weights split by work: a thread's range may start or end inside a panel (its
    row tiles shared with the next thread) and the narrow edge panel counts for less. Every
    (panel, row tile) must be computed exactly once, at every team size, specialised and
    generic, with and without the edge panel."""
    torch.set_num_threads(nthreads)
    torch.manual_seed(40 + nthreads)
    for m, n, k in [(40, 1024, 96), (64, 2000, 64), (29, 1536, 48), (50, 16 * 48, 32)]:
        w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        x = torch.randn(m, k).to(dtype)
        ref = F.linear(x.float(), w.float(), b.float())
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else \
            dict(rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
        for rows in (m, None):
            got = make_linear(w, b, rows)(x)
            assert not got.float().isnan().any()
            torch.testing.assert_close(got.float(), ref, **tol)


@pytest.mark.parametrize("nthreads", [2, 3])
def test_decode_attention_splits_heads_by_bytes(nthreads):
    """One query row against a long KV cache: few flops, but K and V worth reading on every
    thread, so the heads are split across the team (GQA too, and strided caches as the in-place
    KV append makes them); the answer is ATen's at every team size."""
    torch.set_num_threads(nthreads)
    torch.manual_seed(nthreads)
    for heads, kv_heads, lk in [(12, 12, 160), (12, 4, 301), (5, 5, 999)]:
        q = torch.randn(1, heads, 1, 64)
        k, v = (torch.randn(1, kv_heads, lk + 37, 64)[:, :, :lk] for _ in range(2))
        gqa = {} if kv_heads == heads else {"kv_heads": kv_heads}
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=bool(gqa))
        for fn in (make_sdpa(1, heads, 1, lk, 64, 64, **gqa),
                   make_sdpa(None, heads, None, None, 64, 64, **gqa)):
            torch.testing.assert_close(fn(q, k, v), ref, rtol=1e-5, atol=1e-5)


def test_concurrent_calls_from_python_threads():
    torch.manual_seed(0)
    w, b = torch.randn(300, 200), torch.randn(300)
    lin = make_linear(w, b, 64, "gelu")
    q = torch.randn(2, 2, 50, 32)
    att = make_sdpa(2, 2, 50, 50, 32, 32, True)
    ref_att = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    errors = []

    def work(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(50):
            x = torch.randn(64, 200, generator=g)
            if not torch.allclose(lin(x), F.gelu(F.linear(x, w, b)), rtol=1e-4, atol=1e-4):
                errors.append("linear")
            if not torch.allclose(att(q, q, q), ref_att, rtol=1e-4, atol=1e-5):
                errors.append("sdpa")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
