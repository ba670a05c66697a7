"""The drop-in ops' size thresholds, measured on this CPU instead of taken from another one.

Below ``MIN_NUMEL`` elements or rows shorter than ``MIN_ROW`` (``ops/sorting.py``) a call goes
to ATen, whose kernel is then faster than Kwker's call overhead plus per-row set-up. The
built-in values are crossovers measured on a Zen 4. ``calibrate`` measures each family's
Kwker and ATen times on a grid of shapes (1-64 rows of 32-32768 elements, float32), picks the
thresholds under which the chosen side is fastest over the grid, and records them
(``runtime/tuning.py``: per CPU identity, thread count and Kwker version). ``apply`` puts the
record of this machine, if any, into the thresholds; ``kwker-cache prewarm`` calibrates.
The same record holds the kernels' algorithm switches (``sorting.SWITCHES``), each measured
both ways, and the row length from which the radix sort takes byte digits
(``sorting.RADIX_BYTES_ROW``). Either side gives ATen's exact answer, so thresholds only ever
change speed.
"""
from __future__ import annotations

import math
import threading

import torch

from ..runtime import tuning
from ..runtime.target import host_target
from . import sorting as S

PROBLEM = '{"drop-in thresholds": 1}'
ROWS = (1, 8, 64)
LENGTHS = (32, 128, 512, 2048, 8192, 32768)
MAX_NUMEL = 1 << 19
NUMEL_STEPS = (0, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384, 32768, 65536, 131072)
ROW_STEPS = (0, 32, 64, 128, 256, 512, 1000, 2048, 8192)
BUDGET_S = 0.03  # timing per grid point and side, after the first rounds


def _calls(family: str, x: torch.Tensor):
    """(Kwker's call, ATen's call) of one family on ``x`` (rows along the last dim)."""
    n = x.shape[-1]
    if family == "topk":
        k = min(10, n)
        return (lambda: S.fast_topk(x, k)), (lambda: torch.topk(x, k))
    if family in ("sort", "stable"):
        stable = family == "stable"
        return (lambda: S.fast_sort(x, stable)), (lambda: torch.sort(x, stable=stable))
    # the index reductions' overrides get the out tensors of ATen's wrapper: timed so
    if family == "kthvalue":
        return (lambda: S.fast_kthvalue(x, n // 2 + 1, outs=_fresh(x))), \
            (lambda: torch.kthvalue(x, n // 2 + 1))
    if family == "median":
        return (lambda: S.fast_median_dim(x, -1, outs=_fresh(x))), (lambda: torch.median(x, -1))
    if family == "mode":
        return (lambda: S.fast_mode(x, -1)), (lambda: torch.mode(x, -1))
    flat = x.reshape(-1)
    return (lambda: S.fast_median_all(flat)), (lambda: torch.median(flat))


def _fresh(x: torch.Tensor) -> tuple:
    """Empty out tensors, as ATen's functional wrapper hands them to an out= override."""
    return torch.empty(0, dtype=x.dtype), torch.empty(0, dtype=torch.int64)


FAMILIES = ("topk", "sort", "stable", "kthvalue", "median", "median_all", "mode")


def measure(family: str) -> list[tuple[int, int, float, float]]:
    """(rows, length, Kwker seconds, ATen seconds) over the grid, Kwker forced at every size
    (ATen's kernels are called directly: the overrides need not be installed)."""
    rows_set = (1,) if family == "median_all" else ROWS
    saved = S.MIN_NUMEL[family], S.MIN_ROW[family]
    S.MIN_NUMEL[family], S.MIN_ROW[family] = 0, 0
    points = []
    try:
        for rows in rows_set:
            for n in LENGTHS:
                if rows * n > MAX_NUMEL:
                    continue
                x = torch.randn(rows, n)
                kw, at = _calls(family, x)
                if kw() is NotImplemented:
                    continue
                t_kw, t_at = tuning.best_times([kw, at], [], budget=BUDGET_S)
                points.append((rows, n, t_kw, t_at))
    finally:
        S.MIN_NUMEL[family], S.MIN_ROW[family] = saved
    return points


def fit(points, default: tuple[int, int]) -> tuple[int, int]:
    """(min numel, min row) under which the side chosen at each point loses least time over
    the grid (sum of log(chosen / fastest)); the built-in pair is kept when it is as good."""
    def loss(numel_min, row_min):
        total = 0.0
        for rows, n, t_kw, t_at in points:
            chosen = t_kw if rows * n >= numel_min and n >= row_min else t_at
            total += math.log(chosen / min(t_kw, t_at))
        return total
    best, best_loss = default, loss(*default) - 1e-9
    for numel_min in NUMEL_STEPS:
        for row_min in ROW_STEPS:
            cand = loss(numel_min, row_min)
            if cand < best_loss:
                best, best_loss = (numel_min, row_min), cand
    return best


def _timed_both_ways(table: dict, key: str, values: tuple, call) -> list[float]:
    """Seconds of ``call()`` with ``table[key]`` set to each of ``values`` in turn (the
    kernels' switches are read per call), the entry restored after."""
    saved = table[key]

    def with_value(value):
        def run():
            table[key] = value
            return call()
        return run
    try:
        return tuning.best_times([with_value(v) for v in values], [], budget=BUDGET_S)
    finally:
        table[key] = saved


def measure_presort() -> tuple[float, float]:
    """(seconds with the presort switch on, off) of the unstable sort of random float32 rows
    long enough to take it: which of the two is faster depends on the CPU (the radix sort's
    scattered stores against introsort's partitions)."""
    x = torch.randn(8, 8192)
    on, off = _timed_both_ways(S.SWITCHES, "presort", (True, False), lambda: S.fast_sort(x))
    return on, off


RADIX_LENGTHS = (4096, 8192, 16384, 32768)


def measure_radix_bytes() -> list[tuple[int, float, float]]:
    """(row length, seconds with byte digits, with 11-bit digits) of the stable sort of 8
    random float32 rows (every 11-bit digit of their keys varies), at each ``RADIX_LENGTHS``:
    how long a row must be before 256 buckets beat 2048 depends on the CPU's caches."""
    points = []
    for n in RADIX_LENGTHS:
        x = torch.randn(8, n)
        on, off = _timed_both_ways(S.RADIX_BYTES_ROW, "row", (n, 0),
                                   lambda x=x: S.fast_sort(x, True))
        points.append((n, on, off))
    return points


def pick_radix_bytes_row(points) -> int:
    """The shortest measured length from which byte digits were as fast at every longer one
    (0: at none, keep 11-bit digits)."""
    row = 0
    for n, on, off in sorted(points, reverse=True):
        if on > off:
            break
        row = n
    return row


def calibrate() -> dict:
    """Measure every family on this machine, record the thresholds and switches and apply
    them."""
    result = {}
    with tuning.LoadWatch() as watch:
        for family in FAMILIES:
            points = measure(family)
            if points:
                result[family] = list(fit(points, (_DEFAULTS[family])))
        on, off = measure_presort()
        radix = measure_radix_bytes()
    switches = {"presort": on <= off}
    body = {"choice": "measured", "op": "drop-in thresholds",
            "thresholds": result, "switches": switches,
            "radix_bytes_row": pick_radix_bytes_row(radix),
            "times_us": {"presort": round(on * 1e6, 1), "introsort": round(off * 1e6, 1),
                         "radix bytes / 11-bit": {
                             str(n): [round(a * 1e6, 1), round(b * 1e6, 1)]
                             for n, a, b in radix}}}
    if watch.disturbed:   # applied here, not recorded (tuning.LoadWatch)
        tuning.warn_disturbed("the drop-in ops' size thresholds", watch.share)
    else:
        body = tuning.store(PROBLEM, host_target(), torch.get_num_threads(), body)
    _set(body["thresholds"], body["switches"], body["radix_bytes_row"])
    return result


_DEFAULTS = {f: (S.MIN_NUMEL[f], S.MIN_ROW[f]) for f in S.MIN_NUMEL}
_applied = threading.Lock()
_state = {"done": False}


def _set(thresholds: dict, switches: dict | None = None, radix_row=None) -> None:
    for family, (numel_min, row_min) in thresholds.items():
        if family in S.MIN_NUMEL:
            S.MIN_NUMEL[family], S.MIN_ROW[family] = int(numel_min), int(row_min)
    for name, on in (switches or {}).items():
        if name in S.SWITCHES and isinstance(on, bool):
            S.SWITCHES[name] = on
    if isinstance(radix_row, int) and not isinstance(radix_row, bool) and radix_row >= 0:
        S.RADIX_BYTES_ROW["row"] = radix_row


def apply() -> dict | None:
    """Once per process: this machine's recorded thresholds into ``ops.sorting`` (None, and the
    built-in ones, when there is no record or tuning is off)."""
    with _applied:
        if _state["done"]:
            return _state.get("thresholds")
        _state["done"] = True
        if not tuning.measuring():
            return None
        record = tuning.load(PROBLEM, host_target(), torch.get_num_threads())
        if record is None or not isinstance(record.get("thresholds"), dict):
            return None
        switches = record.get("switches")
        _set(record["thresholds"], switches if isinstance(switches, dict) else None,
             record.get("radix_bytes_row"))
        _state["thresholds"] = record["thresholds"]
        return record["thresholds"]
