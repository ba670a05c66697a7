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

from ..runtime import tuning

log = logging.getLogger("kwker")


def pick(family: str, problem: dict, candidates: dict[str, Callable[[], Callable]],
         inputs: Callable[[], list]) -> tuple[str, Callable]:
    """(name, built kernel) of the fastest of ``candidates`` (name -> builder) for ``problem``
    (plain data naming the sizes and flags); ``inputs()`` makes arguments for a call."""
    choice, built = _decide(family, problem, candidates, inputs)
    return choice, built.get(choice) or candidates[choice]()


def winner(family: str, problem: dict, candidates: dict[str, Callable[[], Callable]],
           inputs: Callable[[], list]) -> str:
    """The name alone of ``pick``'s choice, nothing built once it is recorded: for a choice
    that shapes other kernels (a field of their specs) rather than being the kernel itself."""
    return _decide(family, problem, candidates, inputs)[0]


def _decide(family: str, problem: dict, candidates: dict, inputs) -> tuple[str, dict]:
    names = list(candidates)
    if len(names) == 1 or not tuning.measuring():
        return names[0], {}
    key = json.dumps({"family": family, "variants": names, **problem}, sort_keys=True)
    record, built = tuning.decide(key, family + " variant", candidates, inputs)
    if built:
        log.info("kwker: %s %s: %s", family, problem, ", ".join(
            f"{n} {t:g} us" for n, t in record["times_us"].items()))
    return record["choice"], built
