"""Dynamic shapes: new sizes run on generic kernels, with no dynamo recompile and no LLVM compile.

Counted, not timed: after the second size a call must neither add a graph (a dynamo recompile
reaches the backend as a new report) nor load a kernel object (the runtime's hit and miss
counters), and answers match eager at every size.
"""
import copy
import os
import sys

import pytest
import torch

import kwker.dynamo as kd
from kwker.runtime.kernel import stats as kernel_stats

from .models import GPTDecoder, assert_bf16_contract, assert_close, generate


def _loads() -> int:
    return kernel_stats["hits"] + kernel_stats["misses"]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A kernel cache of its own: what the test counts cannot come from an earlier run."""
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    kd.clear_reports()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_kv_cache_decoding_matches_eager_token_for_token(inner, empty_cache):
    """Greedy decoding with a KV cache (the key length grows by one per call): the same tokens
    as eager, attention generic over the key length, nothing built after the second step."""
    torch.manual_seed(0)
    model = GPTDecoder(vocab=512, d=64, heads=4, layers=2, max_len=64).eval()
    prompt = torch.randint(0, 512, (1, 7))
    reference = generate(model, prompt, 20)
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    counts = []

    def step(ids, past):
        out = compiled(ids, past)
        counts.append((len(kd.all_reports()), _loads()))
        return out

    assert torch.equal(generate(step, prompt, 20), reference)
    # prompt, first decode step (static), second (symbolic key length): then nothing new
    assert len(set(counts[3:])) == 1, counts
    decode = kd.all_reports()[-1]
    sdpa = [g for name, _, _, g in decode.kernels if name == "sdpa"]
    assert sdpa == ["generic", "generic"], decode
    assert "linear" in decode.kernel_names and not decode.missed, decode
    assert torch.equal(generate(compiled, prompt, 20), reference)  # and again, warm


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_encoder_layer_dynamic_sequence_lengths(inner, empty_cache):
    """TransformerEncoderLayer under dynamic=True: linears and attention run as generic
    kernels at every sequence length, compiled once."""
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).eval()
    compiled = torch.compile(layer, backend="kwker", options={"inner": inner}, dynamic=True)
    loads = []
    with torch.no_grad():
        for seq in (17, 18, 31, 64, 1, 97, 200, 23):
            x = torch.randn(2, seq, 64)
            assert_close(compiled(x), layer(x))
            loads.append(_loads())
    assert len(set(loads[1:])) == 1, loads
    kernels = {(name, g) for r in kd.all_reports() for name, _, _, g in r.kernels}
    assert ("sdpa", "generic") in kernels, kd.last_report()
    assert any(name.startswith("linear") and g == "generic" for name, g in kernels)


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_everything_symbolic_attention(inner, empty_cache):
    """dynamic=True makes heads and head size symbolic too: they are pinned (guarded), the
    batch and lengths stay generic, and lq != lk works causal, as ATen means it."""
    torch.manual_seed(8)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    compiled = torch.compile(attend, backend="kwker", options={"inner": inner}, dynamic=True)
    loads = []
    with torch.no_grad():
        for b, lq, lk in ((2, 17, 17), (3, 5, 40), (1, 64, 64), (2, 1, 9), (4, 33, 20)):
            q, k, v = torch.randn(b, 4, lq, 32), torch.randn(b, 4, lk, 32), \
                torch.randn(b, 4, lk, 32)
            assert_close(compiled(q, k, v), attend(q, k, v))
            loads.append(_loads())
    assert len(set(loads[1:])) == 1, loads
    assert kd.last_report().kernel_sizes == ["generic"], kd.last_report()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_many_row_counts_one_kernel(inner, empty_cache):
    """M = 1, primes, and sizes past every tile and block: one generic kernel per linear."""
    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 24)).eval()
    compiled = torch.compile(model, backend="kwker", options={"inner": inner})
    loads = []
    with torch.no_grad():
        for b in (5, 6, 1, 2, 3, 7, 11, 12, 13, 24, 25, 97, 263, 1031):
            x = torch.randn(b, 40)
            assert_close(compiled(x), model(x))
            loads.append(_loads())
    assert len(set(loads[1:])) == 1, loads


@pytest.mark.parametrize("inner", ["eager", "inductor"])
@pytest.mark.parametrize("form", ["to", "autocast"])
def test_bf16_batch_sweep(form, inner, empty_cache):
    """bfloat16 (both ways users write it) at new batch sizes: generic bf16 kernels, no new
    kernel after the second size, the bf16 accuracy contract at every size."""
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(48, 160), torch.nn.GELU(),
                                torch.nn.Linear(160, 40)).eval()
    low = model if form == "autocast" else copy.deepcopy(model).to(torch.bfloat16)
    compiled = torch.compile(low, backend="kwker", options={"inner": inner})
    loads = []
    with torch.no_grad():
        for b in (4, 6, 1, 9, 13, 31, 100):
            x = torch.randn(b, 48)
            xl = x if form == "autocast" else x.to(torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=form == "autocast"):
                got, eager = compiled(xl), low(xl)
            assert_bf16_contract(got, eager, model(x))
            loads.append(_loads())
    assert len(set(loads[1:])) == 1, loads
    last = kd.last_report()
    assert last.kernel_dtypes == ["bfloat16", "bfloat16"], last
    assert last.kernel_sizes == ["generic", "generic"], last


SERVE = """
import torch
from kwker.runtime.kernel import stats
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.GELU(),
                            torch.nn.Linear(96, 24)).eval()
compiled = torch.compile(model, backend="kwker", options={"inner": "eager"}, dynamic=True)
with torch.no_grad():
    for b in (3, 1, 17, 250):
        x = torch.randn(b, 40)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
print("compiled", stats["misses"])
"""


def test_manifest_of_a_dynamic_model_prewarms_every_size(tmp_path):
    """The specs of generic kernels carry no varying size: a manifest written on one machine
    prewarms a fresh cache so that a server compiles nothing at any batch size."""
    import subprocess

    from kwker.runtime.manifest import write_manifest
    torch._dynamo.reset()
    kd.clear_reports()
    model = torch.nn.Sequential(torch.nn.Linear(40, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 24)).eval()
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"}, dynamic=True)
    with torch.no_grad():
        compiled(torch.randn(5, 40))
    specs = [s for r in kd.all_reports() for s in r.specs]
    # the linears generic over rows (m 0), and the chain that calls both, which holds no size
    assert specs and all(getattr(s, "m", None) == 0 for s in specs if s.family != "chain")
    assert [s.family for s in specs].count("chain") == 1, specs
    path = write_manifest(tmp_path / "mlp.kwm.json", specs)
    env = dict(os.environ, KWKER_CACHE_DIR=str(tmp_path / "cache"))
    subprocess.run([sys.executable, "-m", "cache_tools", "prewarm", "--manifest", str(path)],
                   env=env, check=True, capture_output=True)
    served = subprocess.run([sys.executable, "-c", SERVE], env=env, check=True,
                            capture_output=True, text=True)
    assert served.stdout.split()[-1] == "0", served.stdout + served.stderr
