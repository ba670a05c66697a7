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
