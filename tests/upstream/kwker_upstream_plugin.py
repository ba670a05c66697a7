"""pytest plugin for running PyTorch's own sorting tests with or without Kwker installed.

Loaded with ``-p kwker_upstream_plugin`` by ``run_upstream.py`` (one pytest process per mode), so
that the only difference between the two runs is whether ``kwker.torch_ops.install()`` was called
before any test ran. Configured through environment variables, not pytest options, because
PyTorch's ``common_utils`` parses ``sys.argv`` itself at import time:

- ``KWKER_UPSTREAM_MODE``: ``aten`` (plain torch) or ``kwker`` (``install()`` for the session).
- ``KWKER_UPSTREAM_REPORT``: where to write the JSON report (per-test outcome, kernel calls).
- ``KWKER_UPSTREAM_NUMPY_COMPAT=1``: restore two NumPy 1.x spellings the upstream tests still
  use (``np.msort``, ``np.quantile(interpolation=...)``), identically in both modes.
- ``KWKER_UPSTREAM_MIN_NUMEL``: lower Kwker's size cut-off so that the tests' small inputs
  reach the JIT kernels instead of ATen (a stress mode; kwker mode only).
- ``KWKER_UPSTREAM_SHADOW=1``: re-run every replaced op call on ATen and compare bit for bit
  (``shadow.py``; kwker mode only).
"""
from __future__ import annotations

import functools
import json
import os

import pytest

_outcomes: dict[str, str] = {}
_state: dict = {"mode": None, "active": False, "min_numel": None, "shadow": None}


def _numpy_compat() -> list[str]:
    """Re-add the NumPy 1.x aliases the upstream tests call; returns what was patched."""
    import numpy as np

    patched = []
    if not hasattr(np, "msort"):
        def msort(a):  # NumPy 1.x: a copy sorted along axis 0
            b = np.array(a, subok=True, copy=True)
            b.sort(axis=0)
            return b
        np.msort = msort
        patched.append("msort")
    for name in ("quantile", "nanquantile"):
        fn = getattr(np, name)
        try:
            fn(np.zeros(1), 0.5, interpolation="linear")
            continue
        except TypeError:
            pass

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, interpolation=None, **kwargs):
            if interpolation is not None:  # NumPy 1.22-1.26 alias of ``method``
                kwargs["method"] = interpolation
            return _fn(*args, **kwargs)
        setattr(np, name, wrapper)
        patched.append(name + "(interpolation=)")
    return patched


def pytest_configure(config):
    mode = os.environ.get("KWKER_UPSTREAM_MODE", "aten")
    if mode not in ("aten", "kwker"):
        raise pytest.UsageError(f"KWKER_UPSTREAM_MODE must be 'aten' or 'kwker', not {mode!r}")
    _state["mode"] = mode
    if os.environ.get("KWKER_UPSTREAM_NUMPY_COMPAT") == "1":
        _state["numpy_compat"] = _numpy_compat()
    if mode == "kwker":
        import kwker.torch_ops as kto

        kto.install()
        if not kto.is_active():
            raise pytest.UsageError(
                "kwker.torch_ops.install() did not activate (unverified torch version?); "
                "the kwker run would only exercise ATen")
        _state["active"] = True
        min_numel = os.environ.get("KWKER_UPSTREAM_MIN_NUMEL")
        if min_numel:
            _lower_cutoff(int(min_numel))
            _state["min_numel"] = int(min_numel)
        if os.environ.get("KWKER_UPSTREAM_SHADOW") == "1":
            from shadow import Shadow

            _state["shadow"] = Shadow()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    shadow = _state["shadow"]
    if shadow is None:
        yield
        return
    shadow.test = item.nodeid
    with shadow:
        yield


def _lower_cutoff(n: int) -> None:
    """Set Kwker's size cut-off (one int, or one per op family) to ``n`` elements."""
    from kwker.ops import sorting

    if not isinstance(getattr(sorting, "MIN_NUMEL", None), dict):
        raise pytest.UsageError("kwker.ops.sorting.MIN_NUMEL not found: cannot lower the "
                                "size cut-off for KWKER_UPSTREAM_MIN_NUMEL")
    sorting.MIN_NUMEL = dict.fromkeys(sorting.MIN_NUMEL, n)
    sorting.MIN_ROW = dict.fromkeys(sorting.MIN_ROW, 0)


def pytest_report_header(config):
    return (f"kwker-upstream: mode={_state['mode']} kwker_active={_state['active']} "
            f"min_numel={_state['min_numel']} numpy_compat={_state.get('numpy_compat')}")


def _outcome(report) -> str | None:
    """One word per phase report; None when the phase adds nothing (a passing setup)."""
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if xfail:
            return "xfailed" if report.skipped else "xpassed"
        return report.outcome
    if report.failed:
        return "error"
    if report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def pytest_runtest_logreport(report):
    word = _outcome(report)
    if word is None:
        return
    prev = _outcomes.get(report.nodeid)
    if prev is None or prev == "passed":  # a teardown error overrides a pass
        _outcomes[report.nodeid] = word


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("KWKER_UPSTREAM_REPORT")
    if not path:
        return
    calls, where = {}, None
    if _state["active"]:
        import kwker
        from kwker.ops import rows

        calls, where = dict(rows.calls), kwker.__file__
    import torch

    shadow = _state["shadow"]
    if shadow is not None and shadow.samples:
        torch.save(shadow.samples, path + ".samples.pt")
    with open(path, "w") as f:
        json.dump({"mode": _state["mode"], "kwker_active": _state["active"],
                   "min_numel": _state["min_numel"],
                   "numpy_compat": _state.get("numpy_compat"),
                   "torch": torch.__version__, "kwker": where, "kernel_calls": calls,
                   "shadow_checked": shadow.checked if shadow else None,
                   "shadow_mismatches": shadow.mismatches if shadow else None,
                   "outcomes": _outcomes}, f, indent=1, sort_keys=True)
