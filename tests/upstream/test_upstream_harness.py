"""The upstream-test harness must notice what it is there to notice (no network, no PyTorch files).

A harness that silently compares ATen with ATen (Kwker not really active, the size cut-off not
really lowered, a bit difference not seen) would report "identical" forever; these checks keep
it honest. The global-state parts run in a subprocess so this suite's own state is untouched.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from run_upstream import compare, summary
from shadow import _differs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_differs_is_bitwise_and_checks_strides():
    nan_a = torch.tensor([float("nan")])
    nan_b = nan_a.view(torch.int32).add(1).view(torch.float32)  # another NaN payload
    assert _differs((nan_a, torch.tensor([0])), (nan_a.clone(), torch.tensor([0]))) is None
    assert "differ" in _differs(nan_a, nan_b)
    assert "differ" in _differs(torch.tensor([0.0]), torch.tensor([-0.0]))
    t = torch.arange(6.0).view(2, 3)
    assert "stride" in _differs(t.t(), t.t().contiguous())
    assert "output 1" in _differs((t, t.long()), (t, t.long() + 1))


def test_compare_and_summary():
    a = {"label": "aten", "outcomes": {"x": "passed", "y": "failed", "z": "skipped"}}
    b = {"label": "kwker", "outcomes": {"x": "passed", "y": "passed"}}
    assert compare(a, b) == [("y", "failed", "passed"), ("z", "skipped", "absent")]
    assert compare(a, a) == []
    assert "| failed | 1 | 0 |" in summary([a, b])


def test_shadow_sees_a_planted_difference_and_cutoff_reaches_kwker():
    script = textwrap.dedent("""
        import numpy as np, torch
        import kwker.torch_ops as kto
        from kwker.ops import rows, sorting
        import kwker_upstream_plugin as plugin
        from shadow import Shadow

        patched = plugin._numpy_compat()
        a = np.random.default_rng(0).standard_normal((5, 4))
        assert (np.msort(a) == np.sort(a, axis=0)).all()
        assert np.quantile(a, 0.3, 0, interpolation="lower").tolist() == \\
            np.quantile(a, 0.3, 0, method="lower").tolist()

        kto.install()
        plugin._lower_cutoff(1)
        small = torch.randn(3, 7)
        before = rows.calls["sort"]
        small.sort()
        assert rows.calls["sort"] == before + 1, "lowered cut-off did not reach Kwker"

        shadow = Shadow()
        with shadow:
            small.sort(); torch.topk(small, 2); small.median(1)
        assert not shadow.mismatches, shadow.mismatches
        real = sorting.fast_sort
        def flipped(*a, **k):
            v, i = real(*a, **k)
            return v, i.flip(-1)
        sorting.fast_sort = flipped
        with shadow:
            small.sort()
        assert [m["op"] for m in shadow.mismatches] == ["sort"], shadow.mismatches
        assert kto.is_active()
        print("ok", patched)
    """)
    path = os.pathsep.join([str(HERE), str(REPO), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       check=False, env={**os.environ, "PYTHONPATH": path})
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
