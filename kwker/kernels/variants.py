"""Measured choice among a kernel family's variants: one mechanism for every factory.

A factory that has more than one way to build a kernel for a problem (the tile or the vector
path, register tiles, screens) names its candidates, built-in default first, and asks ``pick``.
With tuning on, the first time a problem is seen on a machine every candidate is built and
timed on random inputs of the problem's shapes, and the winner is recorded like the lowering's
verdicts (``runtime/tuning.py``: per CPU identity, thread count and Kwker version); later
builds read the record and build only the winner. With ``KWKER_TUNE=off``, under a named target
or emulated tiles, the default is built and nothing is timed.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable

import torch

from ..runtime import tuning
from ..runtime.target import host_target

log = logging.getLogger("kwker")


def pick(family: str, problem: dict, candidates: dict[str, Callable[[], Callable]],
         inputs: Callable[[], list]) -> tuple[str, Callable]:
    """(name, built kernel) of the fastest of ``candidates`` (name -> builder) for ``problem``
    (plain data naming the sizes and flags); ``inputs()`` makes arguments for a call."""
    names = list(candidates)
    default = names[0]
    if len(names) == 1 or not tuning.measuring():
        return default, candidates[default]()
    key = json.dumps({"family": family, "variants": names, **problem}, sort_keys=True)
    target, threads = host_target(), torch.get_num_threads()
    record = None if tuning.mode() == "force" else tuning.load(key, target, threads)
    if record is not None and record.get("choice") in candidates:
        choice = record["choice"]
        return choice, candidates[choice]()
    built = {name: build() for name, build in candidates.items()}
    args = inputs()
    with torch.no_grad():
        times = tuning.best_times(list(built.values()), args)
    choice = names[min(range(len(names)), key=times.__getitem__)]
    tuning.store(key, target, threads, {
        "choice": choice, "op": family + " variant",
        "times_us": {name: round(t * 1e6, 2) for name, t in zip(names, times)}})
    log.info("kwker: %s %s: %s", family, problem, ", ".join(
        f"{n} {t * 1e6:.1f} us" for n, t in zip(names, times)))
    return choice, built[choice]
