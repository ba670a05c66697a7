"""The benchmark harness on one tiny case: it produces rows, and its equality check can fail.

No timing is asserted (the machine is shared); only the harness's logic is.
"""
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench_module(name: str):
    """``benchmarks/<name>.py`` imported with the benchmarks folder on the path meanwhile."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def bs():
    yield from _bench_module("bench_sorting")


@pytest.fixture
def min_numel(monkeypatch):
    """Set the size below which Kwker hands a case to ATen (its policy is not under test)."""
    from kwker.ops import sorting

    def set_min(n):
        monkeypatch.setattr(sorting, "MIN_NUMEL", dict.fromkeys(sorting.MIN_NUMEL, n))
        monkeypatch.setattr(sorting, "MIN_ROW", dict.fromkeys(sorting.MIN_ROW, 0))
    return set_min


def test_run_produces_rows(bs, min_numel):
    min_numel(0)
    c = bs.case("smoke", "topk", (4, 300), k=5, target=1.0)
    rows = bs.run([c], reps=2, warmup=1, min_sample=1e-4, log=lambda *a, **k: None)
    (r,) = rows
    assert r["check"] == "ok"  # a Kwker kernel ran and matched ATen
    assert r["aten_ms"] > 0 and r["kwker_ms"] > 0
    assert r["ratio"] == pytest.approx(r["aten_ms"] / r["kwker_ms"])
    assert r["met"] == (r["ratio"] >= 1.0)
    md = bs.markdown(rows, {"cpu": "x", "cores": 2, "torch": torch.__version__, "threads": 2,
                            "python": "3", "date": "d"}, 2, 1, 1e-4)
    assert "| topk | (4, 300) | float32 | k=5 |" in md and "best of >= 2" in md
    json.dumps(rows)  # the raw results file must be serialisable


def test_handoff_to_aten_is_reported(bs, min_numel):
    min_numel(10**9)
    (r,) = bs.run([bs.case("sweep", "sort", (8,))], reps=1, warmup=0, min_sample=1e-4,
                  log=lambda *a, **k: None)
    assert r["check"] == "ok, ATen path" and r["target"] == bs.FLOOR
    assert "sort" in bs.sweep_table([r]) and "(8,)" in bs.sweep_table([r])


def test_check_reports_a_wrong_result(bs, min_numel):
    min_numel(0)
    import kwker.torch_ops as kto

    c = bs.case("smoke", "sort", (4, 300))
    x = bs.make_input(c.shape, c.dtype, c.kind)
    assert bs.check(c, x) == "ok"
    # a "Kwker" whose sort returns the indices reversed (seen only while accelerated)
    wrong = dataclasses.replace(c, fn=lambda t: (
        c.fn(t) if not kto.is_active() else (c.fn(t)[0], c.fn(t)[1].flip(-1))))
    assert bs.check(wrong, x).startswith("MISMATCH indices: ")
    r = bs.run_case(wrong, reps=1, warmup=0, min_sample=1e-4)
    assert r["check"].startswith("MISMATCH") and not r["met"]
    assert bs.summary([r])[0].startswith("RESULT MISMATCH (bug): sort (4, 300)")
    assert "**MISMATCH indices" in bs.markdown([r], {"cpu": "x", "cores": 2, "torch": "t",
                                                     "threads": 2, "python": "3",
                                                     "date": "d"}, 1, 0, 1e-4)


def test_same_compares_nan_positions_and_strides(bs):
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert bs._same(a, a.clone()) is None
    assert bs._same(a, torch.tensor([1.0, 2.0, 3.0])) == "NaN positions differ"
    assert "elements differ" in bs._same(a, torch.tensor([1.0, float("nan"), 4.0]))
    m = torch.zeros(3, 2)
    assert "strides" in bs._same(m, m.t().contiguous().t())


@pytest.fixture(scope="module")
def common():
    yield from _bench_module("common")


def test_samples_pause_where_the_thread_pool_changes_then_wake(common, monkeypatch):
    """A settle's pause comes before a side whose thread pool differs from the last side's, not
    between torch's sides; untimed calls come before every sample; every sample is taken."""
    sleeps, calls = [], []
    monkeypatch.setattr(common.time, "sleep", sleeps.append)
    monkeypatch.setattr(common, "WAKE", 0.0)
    sides = [common.Side("eager", lambda: calls.append("eager")),
             common.Side("kwker", lambda: calls.append("kwker")),
             common.Side("ort", lambda: calls.append("ort"), pool="onnxruntime")]
    common.sample_round(sides, reps=2, number=1, settle=0.04)
    assert sleeps == [0.04] * 3   # before eager, ort; then (reversed) before kwker
    # one untimed call (WAKE 0), then the timed one
    assert calls == ["eager", "eager", "kwker", "kwker", "ort", "ort",
                     "ort", "ort", "kwker", "kwker", "eager", "eager"]
    assert [len(s.samples) for s in sides] == [2, 2, 2]
    sleeps.clear()
    calls.clear()
    common.sample_round(sides, reps=2, number=1)
    assert sleeps == [] and len(calls) == 6


def test_run_all_survives_a_failing_script_and_indexes_results(tmp_path):
    sys.path.insert(0, str(BENCH))
    try:
        run_all = importlib.import_module("run_all")
    finally:
        sys.path.remove(str(BENCH))
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    (scripts / "bench_broken.py").write_text("raise SystemExit(3)\n")
    (scripts / "bench_good.py").write_text(
        "import json, pathlib, sys\n"
        f"out = pathlib.Path({str(results)!r})\n"
        "assert sys.argv[1:] == ['--quick']\n"
        "(out / 'good.md').write_text('# good')\n"
        "(out / 'good.json').write_text(json.dumps({'headline': [\n"
        "    {'label': 'op A', 'ratio': 4.5, 'target': 4}, {'label': 'op B', 'ratio': 0.5,\n"
        "    'target': 0.9}], 'machine': {'cpu': 'znver4', 'date': 'today'}}))\n")
    (results / "other.json").parent.mkdir()
    (results / "other.json").write_text('{"rows": [{"ratio": 2.0}, {"ratio": 8.0}]}')
    failed = run_all.run_all(["bench_broken.py", "bench_good.py", "bench_absent.py"],
                             ["--quick"], scripts_dir=scripts, results=results)
    assert failed == ["bench_broken.py"]
    index = (results / "README.md").read_text()
    good = next(line for line in index.splitlines() if "bench_good.py" in line)
    assert "[good.md](good.md) [good.json](good.json)" in good and "| ok (--quick" in good
    assert "op A: 4.50x;" in good and "op B: 0.50x (target 0.9x)" in good
    assert "znver4, today" in good
    assert "| (no results file) | bench_broken.py | — | exit 3 (" in index
    assert "bench_absent.py" not in index
    assert "2 cases: min 2.00x, geomean 4.00x, max 8.00x" in index  # other.json, no headline


# ------------------------------------------------------------------ bench_dynamic.py harness
@pytest.fixture(scope="module")
def bd():
    yield from _bench_module("bench_dynamic")


def _sweep(ms: dict, first=0.5, err=0.0) -> dict:
    rows = [{"size": s, "first_ms": first, "steady_ms": t, "err": err, "graphs": 0, "llvm": 0,
             "kernel_sizes": ["specialised"]} for s, t in ms.items()]
    return {"rows": rows, "totals": {"llvm_compiles": 4, "compile_s": 1.0, "cache_loads": 0,
                                     "dynamo_graphs": 2, "kwker_graphs": 2}, "kernels": {}}


def test_dynamic_sweep_rows_and_order(bd):
    import dynamic_sweeps as ds
    order = ds.sizes("ranker", quick=False)
    assert sorted(order) == list(range(1, 65)) and order != sorted(order)
    assert order == ds.sizes("ranker", quick=False)  # seeded
    assert ds.sizes("mlp", quick=False) == list(range(3, 42, 2))
    assert len(ds.sizes("memory", quick=False)) == 40
    model = torch.nn.Linear(4, 3).eval()
    with torch.no_grad():
        rows = ds.sweep(model, {b: (torch.randn(b, 4),) for b in (2, 5)}, "eager", reps=1,
                        log=lambda *a: None)
    assert [r["size"] for r in rows] == [2, 5]
    assert all(r["err"] == 0 and r["steady_ms"] > 0 and r["first_ms"] > 0 for r in rows)


def test_dynamic_targets_can_fail(bd):
    fast = {3: 1.0, 5: 1.0, 7: 1.0}
    good = {"kwker_eager": _sweep(fast), "kwker": _sweep(fast), "spec": _sweep(fast),
            "inductor": _sweep({3: 1.5, 5: 1.5, 7: 1.5}), "eager": _sweep(fast)}
    ts = bd.targets({"mlp": good})
    assert ts and all(t["met"] for t in ts), ts
    slow = dict(good, kwker=_sweep({3: 1.0, 5: 1.0, 7: 2.0}, first=30.0))  # a stall, a slow size
    bad = {t["target"] for t in bd.targets({"mlp": slow}) if not t["met"]}
    assert any("no first call > 5 ms" in t for t in bad)
    assert any("Inductor dynamic" in t and t.startswith("Kwker (default)") for t in bad)
    assert not any(t.startswith("Kwker inner=eager") for t in bad)
    assert "**NOT met**" in bd.targets_table(bd.targets({"mlp": slow}))
    assert "| 7 |" in bd.sweep_table(slow, "batch")


def test_dynamic_problems_report_wrong_tokens_and_memory(bd):
    gen = {"first_s": 3.0, "steady_s": 1.0, "tok_s": 64.0, "totals": {}}
    gpt = {"eager": dict(gen, tokens=[1, 2, 3]), "kwker_eager": dict(gen, tokens=[1, 2, 4])}
    assert bd.problems({"gpt": gpt}) == ["gpt/kwker_eager: tokens differ from eager"]
    assert bd.same_tokens(gpt["kwker_eager"], gpt["eager"]) == "NO (first difference at token 2)"
    mem = {"kwker_eager": {"sizes": list(range(40)), "weights_mb": 32.0, "growth_mb": 70.0,
                           "rss_mb": [1.0, 71.0], "peak_growth_mb": 70.0, "totals": {}}}
    t, missing = bd.targets({"memory": mem})
    assert not t["met"] and "2.19x" in t["value"]
    assert missing["target"] == "Kwker (default) ran" and not missing["met"]
    spec = _sweep({3: 1.0})
    spec["rows"][0]["kernel_sizes"] = ["generic", "specialised"]
    assert bd.problems({"mlp": {"spec": spec}})[0].startswith("mlp/spec: the reference")
    assert bd.problems({"mlp": {"kwker": _sweep({3: 1.0}, err=1.0)}})[0].startswith(
        "mlp/kwker: max abs error")


# ------------------------------------------------------------------ bench_package.py harness
@pytest.fixture(scope="module")
def bp():
    yield from _bench_module("bench_package")


def test_package_overhead_is_the_call_without_its_kernels(bp, tmp_path):
    """The stubbed package answers exactly as the real one (stored kernel answers), so what it
    costs is everything but the kernels."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8)).eval()
    import kwker
    pkg = kwker.load_package(bp.build_package(model, 32, 16, tmp_path))
    x = torch.randn(3, 32)
    call, over = bp.overhead_us(pkg, x, reps=2)
    assert 0 < over < call
    with torch.no_grad():
        torch.testing.assert_close(pkg(x), model(x), rtol=1e-4, atol=1e-5)


def test_package_read_floor_reads_the_weights_bytes(bp):
    """The memory floor of a batch-1 call: a JIT'd read of as many bytes as the weights (its
    probe had moved to probes.py and the benchmark stopped at this row)."""
    model = torch.nn.Linear(256, 1024)
    floor = bp.read_floor(model)
    floor()
    buf = floor.__defaults__[0][0]      # the buffer the call reads
    assert buf.numel() * 4 == sum(p.numel() * 4 for p in model.parameters())


def _call_row(model, batch, us, over=1.0):
    return {"model": model, "batch": batch, "us": us,
            "ratios": {k: v / us["package"] for k, v in us.items()},
            "overhead": {"call_us": us["package"], "over_us": over}, "kernels": []}


def test_package_targets_can_fail(bp):
    start = {"total": 0.3, "dynamo": False, "compiles": 0, "import_torch": 1.0, "load": 0.3,
             "first_call": 0.001, "packaged": 3, "package_mb": 1.0}
    good = [_call_row("Ranker", 1, {"package": 50.0, "kwker_eager": 80.0, "onnxruntime": 90.0}),
            _call_row("MLP", 1, {"package": 100.0, "kwker_eager": 140.0, "read_floor": 90.0})]
    assert all(t["met"] for t in bp.targets(good, start))
    bad = [_call_row("Ranker", 1, {"package": 50.0, "kwker_eager": 60.0, "onnxruntime": 90.0},
                     over=9.0)]
    missed = [t["what"] for t in bp.targets(bad, dict(start, dynamo=True)) if not t["met"]]
    assert any("inner=eager" in w for w in missed) and any("over the kernels" in w
                                                           for w in missed)
    assert any("fresh process" in w for w in missed)
    md = bp.markdown({"machine": {"cpu": "x", "cores": 2, "torch": "t", "threads": 2,
                                  "python": "3", "date": "d"}, "calls": good,
                      "startup": start, "targets": bp.targets(good, start)})
    assert "| Ranker | 1 | 50.0 | 80.0 (1.60x)" in md and "floor" in md


# ------------------------------------------------------------------ bench_ops.py harness
@pytest.fixture(scope="module")
def bo():
    yield from _bench_module("bench_ops")


def test_single_ops_rows_and_table(bo, monkeypatch, tmp_path):
    """One case through the harness: three compiles, the decision text, the summary line that
    names cases below the floor."""
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bo, "cases", lambda quick: [
        ("linear", "7x33x65", bo.Linear(65, 33), (torch.randn(7, 65),), torch.float32)])
    (row,) = bo.run(quick=True, reps=1, rounds=1)
    assert row["floor_ms"] > 0 and row["tuned_ms"] > 0 and row["fixed_ms"] > 0
    assert row["ratio"] == pytest.approx(row["floor_ms"] / row["tuned_ms"])
    assert row["decision"].startswith(("kernel linear on ", "ATen: ATen ")), row["decision"]
    fast, slow = dict(row, ratio=1.5), dict(row, ratio=0.5)  # the summary's logic, not timing
    md = bo.render([fast, slow], {"cpu": "x", "cores": 2, "torch": "t", "threads": 2,
                                 "python": "3", "date": "d"})
    assert "Tuned cases below 1.0x: 1 (linear 7x33x65 float32 0.50x)" in md
    assert os.environ.get("KWKER_TUNE") == "off"  # the suite's pin is restored


@pytest.fixture(scope="module")
def dbk():
    yield from _bench_module("decode_breakdown")


def test_decode_breakdown_times_every_step_of_the_program(dbk):
    """The step clock sees each kernel step in its group and the other steps apart, adds up
    to no more than the program's time, leaves the outputs alone and restores the runner and
    the program's steps."""
    from kwker.lowering.runner import Program
    torch.manual_seed(0)
    # the norm a step of its own (softmax on ATen after it), the linears one chained step
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Softmax(-1),
                                torch.nn.Linear(64, 96), torch.nn.ReLU(),
                                torch.nn.Linear(96, 64)).eval()
    x = torch.randn(8, 64)
    compiled = torch.compile(model, backend="kwker", options={"inner": "eager"})
    plain_call = Program.__call__
    with torch.no_grad():
        want = compiled(x)
        parts = dbk.defaultdict(float)
        with dbk.step_clock(parts):
            got = compiled(x)
        timed = dict(parts)
        compiled(x)   # the program's own steps are back: nothing more is clocked
    assert Program.__call__ is plain_call and dict(parts) == timed
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    linears = next(g for word, g in dbk.GROUPS if word == "linear")
    norms = next(g for word, g in dbk.GROUPS if word == "norm")
    assert parts[linears] > 0 and parts[norms] > 0, dict(parts)
    steps = sum(v for k, v in parts.items() if k != "program")
    assert 0 < steps <= parts["program"]
    row = {"weights": "int4", "token_ms": 1.0, "weight_mb": 1.0, "stream_gbps": 10.0,
           "stream_ms": 0.1, "memory_gbps": 5.0,
           "parts_ms": {"call": 1.0, "program": 0.6, linears: 0.5}}
    rows = dbk.table_rows(row)
    assert rows[0][1] == "0.400" and rows[-1] == ["the model call (timed)", "1.000", "100%"]
    text = dbk.render([row], {"name": "gpt2", "layers": 1, "width": 8, "new_tokens": 4}, {})
    assert "0.13 ms (now 10%)" in text and "weights at 2.0 GB/s" in text
    assert "plain read" not in text   # rows recorded before the per-linear read was taken
    text = dbk.render([{**row, "each_gbps": 7.5}], {"name": "gpt2", "layers": 1, "width": 8,
                                                     "new_tokens": 4}, {})
    assert "one call each in the token's order, 7.5 GB/s." in text


# ------------------------------------------------------------- bench_transformers.py harness
@pytest.fixture(scope="module")
def btf():
    yield from _bench_module("bench_transformers")


def test_transformers_rows_checks_and_target(btf, monkeypatch, tmp_path):
    """One tiny model through the float32 harness (four variants checked against eager, the
    lowering counted), then the target line: met at the geomean only if none is below 1.0x."""
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path / "cache"))

    def tiny():
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        return m, (torch.randn(4, 32),)
    monkeypatch.setitem(btf.TRANSFORMERS, "tiny", (tiny, None, False))
    row = btf.measure_f32("tiny", reps=1, rounds=1)
    assert set(row["check"].values()) == {"ok"} and set(row["ms"]) == set(btf.VARIANTS)
    lowered = btf._lowering(row["lowering"]["kwker"])
    assert lowered.startswith(("1 kernels", "2 kernels")), lowered
    assert row["ratio"] == pytest.approx(row["ms"]["eager"] / row["ms"]["kwker"])
    bert, gpt2, moe = btf.TRANSFORMERS_GEOMEAN[0], btf.TRANSFORMERS_GEOMEAN[1], "an MoE"
    fast = [dict(row, model=bert, ratio=2.0), dict(row, model=gpt2, ratio=2.0)]
    assert "met)" in btf.f32_summary(fast)
    # another model counts towards the floor, not the geomean
    assert "geomean **2.00x** eager over 2 models" in btf.f32_summary(
        [*fast, dict(row, model=moe, ratio=1.1)])
    assert "NOT met" in btf.f32_summary([*fast, dict(row, model=moe, ratio=0.95)])


# ------------------------------------------------------------------ bench_generate.py harness
@pytest.fixture(scope="module")
def bgen():
    yield from _bench_module("bench_generate")


def test_generate_harness_checks_tokens(bgen, monkeypatch, tmp_path, capsys):
    """A tiny Llama through generate(), eager and Kwker (tokens equal); then the token checks:
    where two generations part, and a row whose check failed named in the summary."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("KWKER_CACHE_DIR", str(tmp_path / "cache"))
    assert bgen.main(["--quick", "--models", "Llama", "--dtypes", "float32",
                      "--no-inductor"]) == 0
    assert "float32: Kwker" in capsys.readouterr().out
    a = torch.tensor([[7, 7, 1, 2, 3, 4]])
    assert bgen.first_difference(a, a.clone(), 4) == 4
    assert bgen.first_difference(a, torch.tensor([[7, 7, 1, 2, 9, 4]]), 4) == 2
    row = {"model": "m", "dtype": "float32", "ratio": 2.0, "check": "ok",
           "s": {"eager": 2.0, "kwker": 1.0}}
    assert "every check ok" in bgen.summary([row])[0]
    assert "check failed: m" in bgen.summary([row, dict(row, check="tokens differ")])[0]


@pytest.fixture(scope="module")
def bdec():
    yield from _bench_module("bench_decode")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_packaged_transformers_decoder_generates_eager_tokens(bdec, name):
    """bench_decode's package rows: transformers' GPT-2 and Llama (2 layers) with torchao int8
    weights, their prompt and decode step exported through decode_package's cache adapters,
    packaged and loaded, generate eager torchao's tokens, each layer's cache appended by Kwker's
    kernel (the Llama's too, whose exported step repeats its k/v heads for attention) inside
    the step that attends, which also rotates the Llama's q and keys."""
    pytest.importorskip("torchao")
    cfg = bdec.config(name, True)
    model, packaged = bdec.build(cfg, "f32", "int8", "package")
    prompt = torch.randint(0, cfg.vocab_size, (1, bdec.PROMPT))
    want = bdec.generate(model, prompt, 8)[0]
    got = bdec.generate(packaged, prompt, 8)[0]
    assert torch.equal(got, want)
    names = packaged.step.report.kernel_names
    assert names.count("kv_append") == 2 * cfg.num_hidden_layers, names
    assert not packaged.step.report.missed
    assert "gemm_lowbit" in {s.family for s in packaged.step.report.specs}
    # the lone query's causal mask, which the exported step computes, masks nothing: unread
    assert {s.mask for s in packaged.step.report.specs if s.family == "attention"} == {"none"}
    # one step a layer appends, attends and (Llama) rotates q and the new keys first
    steps = [getattr(s, "kernel", "") for s, _ in packaged.step._program.steps]
    fused = "rope_sdpa_kv_append" if name == "llama" else "sdpa_kv_append"
    assert steps.count(fused) == cfg.num_hidden_layers and "rope" not in steps, steps
