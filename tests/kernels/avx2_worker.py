"""Run by test_other_isa.py in a subprocess whose target is overridden (KWKER_CPU/FEATURES):
every factory on that ISA, compared with torch. Prints one line per check, exits 1 on failure."""
import sys

import torch
import torch.nn.functional as F

from kwker.kernels import blocking
from kwker.kernels.eltwise import make_gelu
from kwker.kernels.linear import make_linear
from kwker.kernels.matmul import make_matmul
from kwker.kernels.norm import make_layer_norm
from kwker.kernels.sdpa import make_sdpa
from kwker.kernels.topk import make_linear_topk
from kwker.runtime.target import host_target


F32 = torch.float32


def close(a, b, tol=1e-4):
    return torch.allclose(a, b, rtol=tol, atol=tol)


def sdpa_generic(checks: dict) -> None:
    """One generic attention kernel per config (make_sdpa with sizes None) at several sizes,
    float32 and bf16 (within test_sdpa_bf16.py's error bound), contiguous, strided, masked."""
    for dtype in (torch.float32, torch.bfloat16):
        f = make_sdpa(None, 2, None, None, 24, 24, True, dtype=dtype)
        fm = make_sdpa(None, 2, None, None, 24, 24, mask="float", mask_shape=(1, 1, 0, 0),
                       dtype=dtype)
        for b, lq, lk in [(1, 1, 37), (2, 3, 1), (2, 70, 90), (1, 130, 300)]:
            q, kk, v = (torch.randn(b, 2, n, 24).to(dtype) for n in (lq, lk, lk))
            proj = torch.randn(b, lk, 4, 24).to(dtype).transpose(1, 2)  # k, v as strided views
            ks, vs, am = proj[:, :2], proj[:, 2:], torch.randn(lq, lk).to(dtype)
            cases = {"": (f(q, kk, v), (q, kk, v), None, True),
                     " strided mask": (fm(q, ks, vs, am), (q, ks, vs), am, False)}
            for name, (y, args, m, causal) in cases.items():
                ref = F.scaled_dot_product_attention(*(t.float() for t in args), is_causal=causal,
                                                     attn_mask=None if m is None else m.float())
                if dtype == torch.float32:
                    ok = close(y, ref)
                else:
                    eager = F.scaled_dot_product_attention(*args, attn_mask=m,
                                                           is_causal=causal).float()
                    ok = (y.float() - ref).abs().max() <= \
                        1.25 * (eager - ref).abs().max() + 1e-3 * ref.abs().max()
                checks[f"sdpa generic {dtype} {b}x{lq}x{lk}{name}"] = bool(ok)


def layer_norm(checks: dict) -> None:
    """Generic and fixed-rows kernels at row lengths around this ISA's lanes (masked tails):
    float32 against float64 (rows far from 0 included), bf16 against ATen's bits (but for rare
    one-ulp roundings)."""
    for dt in (torch.float32, torch.bfloat16):
        for d in (1, 3, 9, 33, 100, 384):
            w, b = torch.randn(d), torch.randn(d)
            f, g = make_layer_norm(d, w, b, 1e-5, dtype=dt), \
                make_layer_norm(d, w, None, 1e-5, rows=5, dtype=dt)
            x = (torch.randn(70, d) * 2 + torch.randn(70, 1) * (300 if dt == F32 else 3)).to(dt)
            pairs = [(f(x[:n]), x[:n], b) for n in (1, 2, 70)] + [(g(x[:5]), x[:5], None)]
            oks = []
            for y, xs, bias in pairs:
                if dt == F32:
                    ref = F.layer_norm(xs.double(), (d,), w.double(),
                                       None if bias is None else bias.double())
                    oks.append(close(y.double(), ref, 1e-5))
                else:
                    ref = F.layer_norm(xs, (d,), w, bias).float()
                    oks.append(bool((y.float() != ref).float().mean() < 0.01) and torch.allclose(
                        y.float(), ref, rtol=2 ** -7, atol=1e-3))
            checks[f"layer_norm {dt} d={d}"] = all(oks)


def lowbit(checks: dict) -> None:
    """torchao int8/int4 weight-only linears on this ISA (int4 without AVX-512's table
    lookup), decode rows, their leftovers and the prefill path, against the dequantised
    weights; skipped where torchao is not installed."""
    try:
        from torchao.quantization import (Int8WeightOnlyConfig, IntxWeightOnlyConfig,
                                          MappingType, quantize_)
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        return
    from kwker.kernels.linear_lowbit import dequantized, make_linear_lowbit
    configs = {"int8": Int8WeightOnlyConfig(),
               "int4 asym g32": IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                     granularity=PerGroup(32),
                                                     mapping_type=MappingType.ASYMMETRIC)}
    for name, cfg in configs.items():
        lin = torch.nn.Linear(96, 45)
        quantize_(lin, cfg)
        ref_w = dequantized(lin.weight)
        for m in (1, 6, 21, None):
            fn = make_linear_lowbit(lin.weight, lin.bias.detach(), m, "relu")
            x = torch.randn(m or 9, 96)
            checks[f"lowbit {name} m={m}"] = close(fn(x), torch.relu(F.linear(x, ref_w,
                                                                              lin.bias)), 1e-5)


def sorting(checks: dict) -> None:
    """The drop-in sorts on this ISA's row kernels, identical to ATen (values, indices): the
    radix-sorted copy with a few ties, tie-heavy and all-equal rows (introsort's exact
    partitions, the small stable networks and their stores of every length), NaN and -0.0;
    several threads on one long row."""
    from kwker.ops import sorting as S
    g = torch.Generator().manual_seed(1)
    rows = {"randn": torch.randn(6, 3001, generator=g),
            "4 values": torch.randint(0, 4, (6, 3001), generator=g).float(),
            "500 values": torch.randint(0, 500, (6, 3001), generator=g).float(),
            "equal": torch.zeros(6, 3001)}
    special = torch.randn(6, 3001, generator=g)
    special[:, ::7], special[:, 3::11] = float("nan"), -0.0
    rows["nan, -0.0"] = special
    for name, x in rows.items():
        for stable in (False, True):
            for desc in (False, True):
                got = S.fast_sort(x, stable, -1, desc)
                ref = torch.sort(x, dim=-1, descending=desc, stable=stable)
                checks[f"sort {name} stable={stable} descending={desc}"] = (
                    got is not NotImplemented and torch.equal(got[1], ref.indices) and
                    torch.equal(got[0].view(torch.int32), ref.values.view(torch.int32)))
    x = torch.randint(0, 50, (200_000,), generator=g).float()  # one row over several threads
    got, ref = S.fast_sort(x), torch.sort(x)
    checks["sort one long tie-heavy row"] = got is not NotImplemented and torch.equal(
        got[1], ref.indices)


def main() -> int:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    checks = {}
    for m, n, k, epi in [(1, 37, 70, "gelu"), (5, 100, 33, "relu"), (50, 61, 130, "gelu_tanh"),
                         (9, 40, 50, "silu")]:
        w, b, x = torch.randn(n, k) / k ** 0.5, torch.randn(n), torch.randn(m, k)
        ref = F.linear(x, w, b)
        ref = {"gelu": F.gelu, "relu": torch.relu, "silu": F.silu,
               "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[epi](ref)
        checks[f"linear {m}x{n}x{k} {epi}"] = close(make_linear(w, b, m, epi)(x), ref)
    a, bt = torch.randn(2, 30, 40), torch.randn(2, 50, 40)
    checks["matmul nk"] = close(make_matmul(30, 40, 50, 2, True)(a, bt), a @ bt.transpose(1, 2))
    w, b = torch.randn(70, 33) / 6, torch.randn(70)  # generic over M: every row edge of the tile
    for dt in (torch.float32, torch.bfloat16):
        lin, xs = make_linear(w, b, None, "gelu", dtype=dt), torch.randn(40, 33).to(dt)
        checks[f"linear generic {dt}"] = all(close(
            lin(xs[:m]).float(), F.gelu(F.linear(xs[:m].float(), w.to(dt).float(),
                                                 b.to(dt).float())), 2e-2 if dt != F32 else 1e-4)
            for m in range(1, 41))
    mm = make_matmul(None, 40, 50, None, True)
    checks["matmul generic"] = all(close(mm(a[:n, :m], bt[:n]), a[:n, :m] @ bt[:n].mT)
                                   for n in (1, 2) for m in (1, 7, 30))
    x = torch.randn(5000) * 3
    checks["gelu"] = close(make_gelu(5000)(x), F.gelu(x))
    q, kk, v = torch.randn(2, 2, 70, 24), torch.randn(2, 2, 90, 24), torch.randn(2, 2, 90, 24)
    for causal in (False, True):
        y = make_sdpa(2, 2, 70, 90, 24, 24, causal)(q, kk, v)
        checks[f"sdpa causal={causal}"] = close(
            y, F.scaled_dot_product_attention(q, kk, v, is_causal=causal))
    sdpa_generic(checks)
    layer_norm(checks)
    lowbit(checks)
    sorting(checks)
    w = torch.randint(-2, 3, (2000, 16)).float()
    x = torch.randint(-2, 3, (9, 16)).float()
    vals, idx = make_linear_topk(w, 9, 20)(x)
    rv, ri = torch.topk(x @ w.t(), 20)
    checks["linear_topk ties"] = torch.equal(idx, ri) and torch.equal(vals, rv)
    x8 = torch.randint(-2, 3, (8, 16)).float()  # 8 rows: 4-row tiles on AVX2
    vals, idx = make_linear_topk(w, 8, 20)(x8)
    rv, ri = torch.topk(x8 @ w.t(), 20)
    checks["linear_topk ties, 8 rows"] = torch.equal(idx, ri) and torch.equal(vals, rv)
    g, x = make_gelu(None), torch.randn(5003) * 3  # generic kernels: every edge of this ISA's tiles
    checks["gelu generic"] = all(close(g(x[:n]), F.gelu(x[:n])) for n in (1, 3, 7, 9, 17, 5003))
    x = torch.randint(-2, 3, (25, 16)).float()
    for dt in (torch.float32, torch.bfloat16):
        top = make_linear_topk(w.to(dt), None, 20, dtype=dt)
        same = [torch.equal(a, b) for m in range(1, 26)
                for a, b in zip(top(x[:m].to(dt)), torch.topk(x[:m].to(dt) @ w.to(dt).t(), 20))]
        checks[f"linear_topk generic ties {dt}"] = all(same)
    print(f"target {host_target().describe()} lanes {blocking.lanes()}")
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
