"""Compile a list of specs into the cache for this machine, in parallel processes.

Workers are forked, so spec families registered in the parent (plugins, tests) exist in them, and
they share nothing but the cache directory: its per-key locks keep two workers, or a worker and a
running service, from compiling the same kernel twice.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from tqdm import tqdm

from kwker.runtime import cache, kernel
from kwker.runtime.target import host_target


@dataclass
class Result:
    symbol: str
    status: str  # compiled, cached, failed
    seconds: float
    error: str | None = None


def prewarm_one(spec) -> Result:
    """Load or compile one spec through the normal pipeline; check that it ended up on disk."""
    t0 = time.perf_counter()
    try:
        target = host_target()
        before = kernel.stats["misses"]
        kernel.object_for(spec, target)
        status = "compiled" if kernel.stats["misses"] > before else "cached"
        root = cache.cache_root()
        key = cache.entry_key(spec.id, target)
        if root is None or not cache.entry_path(root, key).exists():
            return Result(spec.symbol, "failed", time.perf_counter() - t0,
                          "compiled but could not be stored in the cache")
        return Result(spec.symbol, status, time.perf_counter() - t0)
    except Exception as e:  # one bad spec must not stop the others; it is reported
        return Result(spec.symbol, "failed", time.perf_counter() - t0,
                      f"{type(e).__name__}: {e}")


def prewarm(specs: list, jobs: int, progress: bool | None) -> list[Result]:
    """Results in the order of ``specs``. ``progress`` None shows a bar only on a terminal."""
    bar = tqdm(total=len(specs), desc="prewarm", unit="kernel", file=sys.stderr,
               disable=(not progress) if progress is not None else None, dynamic_ncols=True)
    results: list[Result | None] = [None] * len(specs)
    try:
        if jobs <= 1 or len(specs) <= 1:
            for i, spec in enumerate(specs):
                results[i] = prewarm_one(spec)
                bar.update()
        else:
            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=ctx) as pool:
                futures = {pool.submit(prewarm_one, s): i for i, s in enumerate(specs)}
                for fut in as_completed(futures):
                    i = futures[fut]
                    try:
                        results[i] = fut.result()
                    except Exception as e:  # a worker died (e.g. killed by the OOM killer)
                        results[i] = Result(specs[i].symbol, "failed", 0.0,
                                            f"worker process died: {e}")
                    bar.update()
    finally:
        bar.close()
    return results


def tune_package(path) -> int:
    """Load the package ``path`` once in this process, which installs its tuning records and
    measures any choice this machine has no record of; returns how many records it uses."""
    from kwker.packaging import load_package
    from kwker.runtime import tuning
    with tuning.recording() as records:
        load_package(path)
    return len(records)


def tune_drop_in() -> dict | None:
    """Measure the drop-in ops' size thresholds on this machine and record them (None when
    tuning is off or the target is not this CPU's own)."""
    from kwker.ops import thresholds
    from kwker.runtime import tuning
    if not tuning.measuring():
        return None
    return thresholds.calibrate()


def default_jobs() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
