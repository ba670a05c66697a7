"""What the model and kernel benchmarks report: headlines, peer columns, JSON, index and plots.

Built from made-up rows (no timing is asserted: the machine is shared); the peers and the
overhead split run on a tiny model where the packages are installed.
"""
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def mods():
    sys.path.insert(0, str(BENCH))
    try:
        yield tuple(importlib.import_module(m) for m in ("bench_models", "bench_kernels",
                                                          "run_all"))
    finally:
        sys.path.remove(str(BENCH))


def model_rows(bm):
    ok = dict.fromkeys(bm.VARIANTS, "ok")
    return [
        {"model": bm.TUTORIAL, "kernels": "linear_topk", "check": {**ok, "onnxruntime": "ok"},
         "ms": {"eager": 3.0, "inductor": 3.0, "kwker_eager": 1.0, "kwker": 1.5,
                "onnxruntime": 2.0},
         "peers": {"onnxruntime": {"how": "torch.onnx dynamo export", "setup_s": 3.0},
                   "openvino": {"skipped": bm.NOT_INSTALLED + " (openvino missing)"}}},
        {"model": "SDPA (8,8,128,32)", "kernels": "sdpa", "check": ok,
         "ms": {"eager": 2.0, "inductor": 2.0, "kwker_eager": 2.5, "kwker": 1.0},
         "peers": {"onnxruntime": {"skipped": "failed: RuntimeError: no"},
                   "openvino": {"skipped": bm.NOT_INSTALLED}}},
    ]


def test_models_headline_tables_and_index(mods, tmp_path):
    bm, _, run_all = mods
    rows = model_rows(bm)
    head = {h["label"]: h["ratio"] for h in bm.headline(rows)}
    assert head[f"{bm.TUTORIAL} Kwker inner=eager vs eager"] == pytest.approx(3.0)
    assert head[f"{bm.TUTORIAL} Kwker inner=eager vs ONNX Runtime"] == pytest.approx(2.0)
    assert head["Kwker inner=eager vs eager, geomean of 2 models"] == pytest.approx(
        (3.0 * 0.8) ** 0.5)
    assert head["lowest vs eager: SDPA (8,8,128,32) Kwker inner=eager"] == pytest.approx(0.8)
    # Kwker's faster variant against the fastest peer that ran
    assert head[f"lowest vs the fastest peer: {bm.TUTORIAL} Kwker inner=eager vs ONNX Runtime"] \
        == pytest.approx(2.0)

    peers = bm.peer_table(rows)
    assert bm.NOT_INSTALLED.replace("|", "\\|") in peers and "failed (below)" in peers
    assert "| 2.00x | 1.33x |" in peers  # ONNX Runtime / each Kwker variant
    notes = "\n".join(bm.peer_notes(rows))
    assert f"ONNX Runtime: torch.onnx dynamo export ({bm.TUTORIAL})" in notes
    assert "failed: RuntimeError: no (SDPA (8,8,128,32))" in notes
    md = bm.markdown(rows, {"cpu": "x", "cores": 2, "torch": "t", "threads": 2, "python": "3",
                            "date": "d"}, 20)
    assert "[models.png](models.png)" in md and "## Peers" in md

    (tmp_path / "models.json").write_text(json.dumps(
        {"script": "bench_models.py", "machine": {"cpu": "znver4", "date": "today"},
         "rows": rows, "headline": bm.headline(rows)}))
    line = next(x for x in run_all.build_index(tmp_path).splitlines() if "bench_models" in x)
    assert f"{bm.TUTORIAL} Kwker inner=eager vs ONNX Runtime: 2.00x;" in line
    assert "lowest vs eager: SDPA (8,8,128,32) Kwker inner=eager: 0.80x (target 1x)" in line


def test_overhead_table_marks_the_target(mods):
    bm = mods[0]
    o = {"model": "m", "steps": 5, "kernel_steps": 3, "compiled_us": 540.0, "graph_us": 500.0,
         "kernels_us": 495.0, "kwker_own_us": 5.0, "kwker_own_direct_us": 1.0,
         "dynamo_us": 40.0, "dynamo_direct_us": 15.0, "noop_dynamo_us": 30.0,
         "total_us": 45.0, "dynamo_inside_us": 30.0, "total_inside_us": 31.0,
         "target_us": 20.0}
    text = bm.overhead_table(o)
    assert "then its 5 steps" in text and "its 3 kernel steps alone" in text
    assert "| 5.0 | target < 20 µs: met |" in text
    assert "| 31.0 | target < 20 µs: NOT met |" in text
    assert "| 45.0 |  |" in text  # a difference of two separate timings: shown, not judged
    assert "not measured: x" in bm.overhead_table({"model": "m", "error": "x"})


def test_kernels_json_rows_and_headline(mods, tmp_path):
    _, bk, run_all = mods
    rows = bk.as_dicts([("GEMM 32x20000x128", 1.0, 2.0, "150 GF/s, 75% of peak", 1.3),
                        ("Ranker b32 (MLP + scores + topk 10)", 1.0, 2.5, "", 3.0),
                        ("GELU erf 64x4096", 1.0, 0.9, "", None)])
    assert rows[0]["ratio"] == 2.0 and rows[0]["met"] and rows[2]["met"] is None
    head = bk.headline(rows)
    furthest = "furthest from its target: Ranker b32 (MLP + scores + topk 10)"
    assert [h["label"] for h in head] == ["Ranker b32 (MLP + scores + topk 10)",
                                          "GEMM 32x20000x128", furthest]
    assert "| 2.50x | 3.0x BELOW |" in bk.render(rows, "# k")
    (tmp_path / "kernels.json").write_text(json.dumps({"script": "bench_kernels.py",
                                                       "headline": head, "rows": rows}))
    index = run_all.build_index(tmp_path)
    assert "Ranker b32 (MLP + scores + topk 10): 2.50x (target 3x); GEMM 32x20000x128: 2.00x;" \
        in index


def test_plots_are_written(mods, tmp_path):
    pytest.importorskip("matplotlib")
    bm, bk, _ = mods
    info = {"cpu": "x", "cores": 2, "torch": "t", "threads": 2, "python": "3", "date": "d"}
    assert bm.plot(model_rows(bm), tmp_path / "models.png", info)
    rows = bk.as_dicts([("GEMM 8x8x8", 1.0, 2.0, "1 GF/s, 1% of peak", 1.3)])
    assert bk.plot(rows, tmp_path / "kernels.png", "title")
    for name in ("models.png", "kernels.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.fixture
def tiny(mods, monkeypatch):
    """A small MLP registered as a benchmark model."""
    bm = mods[0]

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 8))
        return m, (torch.randn(4, 16),)
    monkeypatch.setitem(bm.MODELS, "tiny", make)
    return bm


def test_overhead_split_on_a_tiny_model(tiny):
    o = tiny.overhead("tiny", reps=2, rounds=1)
    assert "error" not in o, o
    assert o["kernel_steps"] >= 1 and o["steps"] >= o["kernel_steps"]
    assert o["kwker_own_direct_us"] > 0 and o["dynamo_direct_us"] > 0
    assert o["total_us"] == pytest.approx(o["compiled_us"] - o["kernels_us"])


@pytest.mark.parametrize("peer", ["onnxruntime", "openvino"])
def test_peer_runs_and_matches_eager(tiny, peer, tmp_path):
    bm = tiny
    if bm.peer_missing(peer):
        pytest.skip(bm.peer_missing(peer))
    model, inputs = bm.build("tiny")
    path = str(tmp_path / "m.onnx")
    with torch.no_grad():
        fn, how = bm.PEER_BUILDERS[peer](model, inputs,
                                         lambda: (path, bm.export_onnx(model, inputs, path)))
        assert bm.check("tiny", model(*inputs), fn()) == "ok", how


# ----------------------------------------------------------------------------- bf16 sections
@pytest.fixture(scope="module")
def bf16mods(mods):
    sys.path.insert(0, str(BENCH))
    try:
        yield tuple(importlib.import_module(m) for m in ("models_bf16", "kernels_bf16",
                                                          "isa_env"))
    finally:
        sys.path.remove(str(BENCH))


def bf16_rows(mb):
    def row(model, mode, ms, err, target=None, beat_ov=False):
        return {"model": model, "mode": mode, "target": target, "beat_openvino": beat_ov,
                "ms": ms, "err": err, "ref_max": 4.0, "bound": 1.25 * err["eager"] + 4e-3,
                "contract": {v: "ok" if err[v] <= 1.25 * err["eager"] + 4e-3 else "BROKEN"
                             for v in mb.KWKER},
                "lowering": {v: {"kernels": 5, "bf16": 5, "graphs": 1, "inner_nodes": 9,
                                 "missed": [], "fallback": [], "names": "linear bfloat16 x5"}
                             for v in mb.KWKER},
                "peers": {"openvino": {"how": "convert_model(module), bf16", "setup_s": 1.0},
                          "onnxruntime": {"skipped": "session: NotImplemented: Gemm(13)"}}}
    tel = "TransformerEncoderLayer (8,128,256)"
    return [
        row(tel, "bf16", {"eager": 6.0, "inductor": 6.0, "kwker_eager": 4.0, "kwker": 5.0,
                          "openvino": 4.4}, {"eager": 0.02, "inductor": 0.02,
                                             "kwker_eager": 0.02, "kwker": 0.02,
                                             "openvino": 0.03}, 1.2, True),
        row(tel, "autocast", {"eager": 6.0, "inductor": 6.0, "kwker_eager": 6.0, "kwker": 5.5,
                              "openvino": 4.4}, {"eager": 0.02, "inductor": 0.02,
                                                 "kwker_eager": 0.05, "kwker": 0.02,
                                                 "openvino": 0.03}, 1.2, True),
        {"model": "transformers BertModel 4x256 (8,128)", "mode": "bf16",
         "skipped": "transformers not installed"},
    ]


def test_bf16_models_tables_contract_headline_and_index(mods, bf16mods, tmp_path):
    _, _, run_all = mods
    mb = bf16mods[0]
    rows = bf16_rows(mb)
    avx2 = {"env": {}, "aten_capability": "AVX2", "kwker_target": "znver3 (AVX2, FMA)",
            "avx512bf16": False, "rows": [{**rows[0], "ms": {"eager": 8.0, "kwker_eager": 4.0}}]}
    bf16 = {"rows": rows, "avx2": avx2, "reps": 5, "rounds": 1}
    speed = mb.speed_table(rows)
    assert "| 1.50x | 1.20x | 1.10x | 1.2x ok; vs OpenVINO: ahead |" in speed
    assert "1.2x BELOW; vs OpenVINO: BEHIND" in speed  # autocast: best Kwker 5.5 ms
    assert "skipped: transformers not installed" in speed
    acc = mb.accuracy_table(rows)
    assert "| BROKEN / ok |" in acc and "5 (5 bf16) in 1 graph(s)" in acc
    assert mb.broken(rows, avx2) == [
        f"{rows[1]['model']} autocast(bf16) Kwker inner=eager: max abs err 0.05 > bound 0.029"]
    md = mb.markdown(bf16)
    assert "### Without AVX512_BF16 (AVX2)" in md and "| 2.00x |" in md
    assert "[models_bf16.png](models_bf16.png)" in md and "Accuracy contract broken" in md
    assert "ONNX Runtime: session: NotImplemented: Gemm(13)" in md
    head = {h["label"]: h for h in mb.headline(bf16)}
    low = head["bf16 lowest vs its target: TransformerEncoderLayer (8,128,256) autocast(bf16)"]
    assert low["ratio"] == pytest.approx(6.0 / 5.5) and low["target"] == 1.2
    assert head["AVX2 bf16: Kwker inner=eager vs eager, geomean of 1 rows"]["ratio"] == 2.0
    assert head[f"bf16 {rows[0]['model']} best Kwker vs OpenVINO bf16"]["ratio"] == \
        pytest.approx(1.1)
    (tmp_path / "models.json").write_text(json.dumps(
        {"script": "bench_models.py", "rows": [], "bf16": bf16, "headline": mb.headline(bf16)}))
    line = next(x for x in run_all.build_index(tmp_path).splitlines() if "bench_models" in x)
    assert "bf16: best Kwker vs eager bf16, geomean of 2 rows" in line
    assert "AVX2 bf16: Kwker inner=eager vs eager, geomean of 1 rows: 2.00x" in line
    assert mb.avx2_table({"error": "child failed", "rows": []}) == \
        "AVX2 rows not run: child failed"
    pytest.importorskip("matplotlib")
    assert mb.plot(bf16, tmp_path / "models_bf16.png", {"cpu": "x", "cores": 2, "torch": "t",
                                                        "threads": 2, "python": "3",
                                                        "date": "d"})
    assert (tmp_path / "models_bf16.png").read_bytes()[:4] == b"\x89PNG"


def test_bf16_kernels_render_headline_and_plot(mods, bf16mods, tmp_path):
    kb = bf16mods[1]
    rows = [kb._row("bf16 linear 1024x1024x1024", 1.0, 1.1, "ok (1e-2 vs eager 1e-2)", 1.0,
                    0.9, gflops=400.0, peak_frac=0.85),
            kb._row("bf16 linear 1x4096x1024", 1.0, 2.0, "ok", 1.5, None, gflops=8.0,
                    peak_frac=0.02, weight_gbps=120.0, l3_frac=0.6),
            kb._row("bf16 MLP 1024-4096-1024 b1", 1.0, 3.0, "BROKEN (1 vs eager 0.1)")]
    for r in rows:
        r["met"] = None if r["target"] is None else bool(
            r["ratio"] >= r["target"] and (r["peak_target"] is None
                                            or r["peak_frac"] >= r["peak_target"]))
    sec = {"peak_gflops": 470.0, "peak_skipped": "", "l3_gbps": 200.0, "l3_bytes": 16 << 20,
           "rows": rows}
    text = kb.render(sec)
    assert "470 GFLOP/s" in text and "200 GB/s" in text and "[kernels_bf16.png]" in text
    assert "| 1.10x | 1x, 90% of peak BELOW | 400 | 85% |" in text  # fast enough, not peak
    assert "| 2.00x | 1.5x ok | 8 | 2% | 120 (60%) |" in text
    head = kb.headline(sec)
    assert [h["label"] for h in head] == [
        "bf16 linear 1024x1024x1024", "bf16 linear 1x4096x1024",
        "bf16 furthest from its target: bf16 linear 1024x1024x1024"]
    skipped = {**sec, "peak_gflops": None, "peak_skipped": "skipped: no AVX512_BF16"}
    assert "skipped: no AVX512_BF16" in kb.render(skipped)
    assert "max-autotune" not in text   # the peer's columns only where it ran
    rows[0] |= {"autotune_ms": 1.5, "autotune_ratio": 1.5}
    rows[1] |= {"autotune_ms": 0.5, "autotune_ratio": 0.5}
    tuned = kb.render(sec)
    assert "| Inductor max-autotune ms | max-autotune / Kwker |" in tuned
    assert "| 1.500 | 1.50x ahead |" in tuned and "| 0.500 | 0.50x BEHIND |" in tuned
    assert tuned.splitlines()[-1].endswith("| | |")   # a row without it
    pytest.importorskip("matplotlib")
    assert kb.plot(sec, tmp_path / "kernels_bf16.png", "t")


def test_bf16_probes_measure_something(bf16mods):
    kb = bf16mods[1]
    peak, why = kb.bf16_peak(1, iters=1 << 12, samples=2)
    assert (peak is None and why.startswith("skipped")) or (peak > 0 and why == "")
    assert kb.l3_bandwidth(1, nbytes=1 << 20, passes=1, samples=2) > 0


def test_isa_flag_parsing(bf16mods):
    isa = bf16mods[2]
    assert isa.wanted(["x.py", "--quick", "--isa", "avx2"]) == "avx2"
    assert isa.wanted(["x.py", "--isa=avx2"]) == "avx2" and isa.wanted(["x.py"]) is None
    assert set(isa.AVX2_ENV) == {"KWKER_CPU", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"}


def test_bf16_row_on_a_tiny_model(bf16mods, monkeypatch):
    """One live row: eager bf16 vs Kwker inner=eager, errors against float32, kernels counted."""
    mb = bf16mods[0]

    def make():
        m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 32))
        return m, (torch.randn(8, 64),)
    monkeypatch.setitem(mb.BF16_MODELS, "tiny", (make, 1.0, False))
    for mode in mb.MODES:
        r = mb.speed("tiny", mode, reps=2, rounds=1, variants=("eager", "kwker_eager"),
                     peer_list=())
        assert r["lowering"]["kwker_eager"]["bf16"] >= 1, r["lowering"]
        assert r["contract"]["kwker_eager"] == "ok", r
        assert r["ms"]["eager"] > 0 and r["ms"]["kwker_eager"] > 0
        assert r["peers"]["openvino"]["skipped"].startswith("not run")
        json.dumps(r)
