"""Tuning records: what was measured on this CPU, kept next to the object code as plain JSON.

A record says which candidate won a measurement (a Kwker kernel variant, or ATen) for one
problem (an op at its sizes, dtypes and layouts) on one machine. Its key hashes the problem,
the target (CPU name, features, tile mode), the thread count and the tuning version (Kwker's
codegen and kernel-factory sources: a changed kernel is measured again). One file per record:
``<cache>/v1/tuning/<key[:2]>/<key>.json``, holding all of that plus a SHA-256 over the rest,
so a truncated, hand-edited or foreign record is detected, removed and measured again, never
trusted. Records are small (~1 KB) and few, so they are not counted against the cache's size
limit; ``kwker-cache clear --tuning`` removes them.

``KWKER_TUNE``: ``on`` (default) measures on first need and reuses records; ``off`` measures
nothing and uses the built-in choices (tests pin them this way); ``force`` measures again and
overwrites the records.

Timings taken while another process used the cores are applied to this process only, not
recorded: this process's threads then wait for a CPU (the scheduler's run-queue time,
``/proc/self/task/*/schedstat``), 0-1% of the timing's length on an idle 2-core Zen 4 and 100%
beside two busy processes. A record measured so would have stood for every later process: a
linear whose 2 threads lost their cores timed 6.4 ms and stayed on ATen. ``KWKER_TUNE_LOAD``
sets that share (default 0.1; ``inf`` records every timing, as on a host that is never idle).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from . import cache
from .collect import Collector
from .target import Target, host_target

MIN_ROUNDS = 5          # interleaved timings of each candidate at least
MAX_ROUNDS = 200
BUDGET_S = 0.15         # time spent timing one problem at most (after the first rounds)
WARMUP_S = 0.02         # each candidate runs this long first (caches, page faults, the AMX unit)
DISTURBED = 0.1         # this process's threads waited for a CPU this share of a timing: not kept

FORMAT = "kwker-tuning-1"
DIR = "tuning"
SUFFIX = ".json"
MODES = ("on", "off", "force")


_used = Collector()


def recording():
    """Yield the list of the records loaded or stored inside (a package carries those its
    lowering used, so loading it on this CPU type measures nothing)."""
    return _used.collecting()


def _note(body: dict) -> dict:
    _used.add(body)
    return body


def mode() -> str:
    """``KWKER_TUNE`` (on, off, force); anything else is an error the user should see."""
    value = os.environ.get("KWKER_TUNE", "on").strip().lower() or "on"
    if value not in MODES:
        raise ValueError(f"KWKER_TUNE must be one of {', '.join(MODES)}, not {value!r}")
    return value


def measuring() -> bool:
    """Whether choices are measured: tuning is on, and the target is this CPU's own (timings
    under ``KWKER_CPU`` or emulated tiles would be recorded for a CPU they say nothing about).
    A bad ``KWKER_TUNE`` or ``KWKER_TUNE_LOAD`` is refused here, before anything is timed."""
    if mode() == "off":
        return False
    load_limit()
    return not os.environ.get("KWKER_CPU") and host_target().tiles != "emulated"


def best_times(fns: list, args: list, budget: float = BUDGET_S) -> list[float]:
    """Best seconds of each ``fn(*args)``, timed round-robin (load hits all alike), after each
    ran ``WARMUP_S``: at least ``MIN_ROUNDS`` rounds, then more within ``budget`` seconds."""
    for f in fns:
        start = time.perf_counter()
        while time.perf_counter() - start < WARMUP_S:
            f(*args)
    best = [float("inf")] * len(fns)
    start, rounds = time.perf_counter(), 0
    clock = time.perf_counter
    while rounds < MIN_ROUNDS or (clock() - start < budget and rounds < MAX_ROUNDS):
        for i, f in enumerate(fns):
            t = clock()
            f(*args)
            best[i] = min(best[i], clock() - t)
        rounds += 1
    return best


class LoadWatch:
    """``with LoadWatch() as w: ...``; then ``w.disturbed``: whether this process's threads
    waited for a CPU more than ``load_limit()`` of the time inside (other processes using the
    cores), and ``w.share`` that time over the wall time (None where the kernel does not say)."""

    def __enter__(self):
        self.share, self._waited, self._start = None, waiting_s(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall, after = time.perf_counter() - self._start, waiting_s()
        if self._waited is not None and after is not None and wall > 0:
            self.share = max(0.0, after - self._waited) / wall

    @property
    def disturbed(self) -> bool:
        return self.share is not None and self.share > load_limit()


def load_limit() -> float:
    """``KWKER_TUNE_LOAD``: the share of a timing this process may wait for a CPU and still
    record it (``DISTURBED`` by default); anything but a number >= 0 is an error to see."""
    value = os.environ.get("KWKER_TUNE_LOAD", "").strip()
    if not value:
        return DISTURBED
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if not limit >= 0:
        raise ValueError(f"KWKER_TUNE_LOAD must be a share of the time >= 0 (e.g. 0.1, or inf "
                         f"to record every timing), not {value!r}")
    return limit


def waiting_s() -> float | None:
    """Seconds this process's threads have spent waiting for a CPU, or None where
    ``/proc/self/task/*/schedstat`` is not there (not Linux, schedstats off)."""
    total, seen = 0, False
    try:
        tasks = list(os.scandir("/proc/self/task"))
    except OSError:
        return None
    for task in tasks:
        try:
            with open(os.path.join(task.path, "schedstat")) as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, ValueError, IndexError):
            continue   # a thread that has ended meanwhile
    return total / 1e9 if seen else None


def warn_disturbed(what: str, share: float) -> None:
    cache.warn_once(
        f"kwker: {what} were timed while other processes used the CPUs (this process waited "
        f"for a core {share:.0%} of the time): they apply to this process only and are measured "
        "again in the next; run kwker-cache prewarm on an otherwise idle machine to record them",
        topic=f"tuning-disturbed: {what}")


def choose(times_us: dict, handicap: dict | None = None) -> str:
    """The winner of measured times: the fastest once each candidate's time has its handicap
    applied (none if absent); ties go to the earlier candidate. A handicap ``(factor, extra us,
    share)`` judges a time ``t`` as ``t * factor + min(extra, share * t)``."""
    handicap = handicap or {}

    def judged(name):
        factor, extra, share = handicap.get(name, (1.0, 0.0, 0.0))
        t = times_us[name]
        return t * factor + min(extra, share * t)
    return min(times_us, key=judged)


def decide(problem: str, op: str, candidates: dict, inputs,
           handicap: dict | None = None, measure: bool = True) -> tuple[dict | None, dict]:
    """(record, built): the record of ``problem`` on this machine (``candidates``: name ->
    builder of a callable, the built-in choice first), measured now when there is none or
    ``KWKER_TUNE=force``: every candidate built, timed on ``inputs()``, the winner by
    ``choose(times, handicap)`` recorded; ``built`` holds the callables built for that (empty
    when the record was read). A record's choice is re-derived from its times, so a changed
    handicap applies to records measured before it. ``measure=False``: a record is only read
    (None and nothing built when there is none)."""
    import torch  # the runtime's other modules do without it; only measuring needs it
    target, threads = host_target(), torch.get_num_threads()
    record = None if mode() == "force" and measure else load(problem, target, threads)
    if record is not None and record.get("choice") in candidates:
        times = record.get("times_us")
        if isinstance(times, dict) and set(times) == set(candidates) and all(
                isinstance(t, (int, float)) and t > 0 for t in times.values()):
            record = {**record, "choice": choose(times, handicap)}
        return record, {}
    if not measure:
        return None, {}
    built = {name: build() for name, build in candidates.items()}
    args = inputs()
    with torch.no_grad(), LoadWatch() as watch:
        times = best_times(list(built.values()), args)
    times_us = {name: round(t * 1e6, 2) for name, t in zip(built, times)}
    result = {"choice": choose(times_us, handicap), "op": op, "times_us": times_us}
    if watch.disturbed:
        warn_disturbed("the tuner's choices", watch.share)
        return {"problem": problem, **result, "disturbed": round(watch.share, 3)}, built
    return store(problem, target, threads, result), built


@functools.cache
def tuning_version() -> str:
    """The codegen version plus a hash of the kernel factories (blockings, variants, packing)."""
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    h = hashlib.sha256(cache.codegen_version().encode())
    for path in sorted(p for p in os.listdir(kernels) if p.endswith(".py")):
        h.update(path.encode())
        h.update((kernels / path).read_bytes())
    return f"{cache.codegen_version()}/{h.hexdigest()[:12]}"


def identity(target: Target, threads: int) -> dict:
    """What a record must match to be used: the machine, the thread count and the versions."""
    return {"target": asdict(target), "threads": threads, "tuning": tuning_version(),
            **cache.versions()}


def record_key(problem: str, target: Target, threads: int) -> str:
    blob = json.dumps({"problem": problem, **identity(target, threads)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def root() -> Path | None:
    base = cache.cache_root()
    return None if base is None else base / DIR


def record_path(key: str, where: Path | None = None) -> Path | None:
    where = where or root()
    return None if where is None else where / key[:2] / (key + SUFFIX)


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def encode(body: dict) -> bytes:
    return json.dumps({**body, "sha256": _digest(body)}, sort_keys=True, indent=1).encode()


def decode(data: bytes) -> dict:
    """The record's body, or ValueError when it is not a whole, unaltered Kwker record."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError("not a Kwker tuning record")
    digest = doc.pop("sha256", None)
    if digest != _digest(doc):
        raise ValueError("checksum mismatch (truncated or edited)")
    return doc


def mismatch(body: dict, problem: str, expect: dict) -> str | None:
    """Why a record that decoded cannot be used for ``problem`` on ``expect``, or None."""
    if body.get("problem") != problem:
        return "another problem under this key"
    for field in ("target", "threads", "tuning", "kwker", "llvm", "llvmlite"):
        if body.get(field) != expect.get(field):
            return f"recorded for another {field}"
    return None


def load(problem: str, target: Target, threads: int) -> dict | None:
    """The record of ``problem`` on this machine, or None (missing, or broken: then removed)."""
    path = record_path(record_key(problem, target, threads))
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        body = decode(data)
        why = mismatch(body, problem, identity(target, threads))
        if why:
            raise ValueError(why)
    except ValueError as e:
        cache.warn_once(f"kwker: tuning record {path} is unusable ({e}); measuring again",
                        topic=f"tuning:{path}")
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return _note(body)


def _write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` atomically, in directories private to this user (their
    failures raise UnusableCache or OSError)."""
    cache.ensure_dir(path.parent.parent.parent)
    for d in (path.parent.parent, path.parent):
        d.mkdir(mode=0o700, exist_ok=True)
        cache.check_private(d)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=cache.TMP_PREFIX, suffix=SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def store(problem: str, target: Target, threads: int, result: dict) -> dict:
    """Write the record of ``problem`` (``result``: choice, times, notes) and return its body;
    a cache that cannot be written only costs the record, never the caller."""
    body = {"format": FORMAT, "problem": problem, **identity(target, threads),
            "created": time.time(), **result}
    body = json.loads(json.dumps(body))  # as a reader decodes it (keys as strings), checksum too
    path = record_path(record_key(problem, target, threads))
    if path is None:
        return _note(body)
    try:
        _write(path, encode(body))
    except (cache.UnusableCache, OSError) as e:
        cache.warn_once(f"kwker: cannot write tuning records under {path.parent}: {e}; "
                        "choices are measured again in the next process", topic="tuning-write")
    return _note(body)


def install(data: bytes) -> bool:
    """Store a record carried by a package (``data`` as ``encode`` wrote it) if it is whole and
    from this Kwker version; a record of another machine is kept too (its key is its own) and
    simply never matches here."""
    try:
        body = decode(data)
        problem, target = body.get("problem"), Target(**body.get("target"))
        threads = int(body.get("threads", 0))
    except (ValueError, TypeError):
        return False
    if not isinstance(problem, str) or mismatch(body, problem, identity(target, threads)):
        return False  # another version's record: its key here would never be looked up
    path = record_path(record_key(problem, target, threads))
    if path is None or path.exists():
        return False
    with contextlib.suppress(cache.UnusableCache, OSError):
        _write(path, data)
        return True
    return False


def iter_records(where: Path | None = None) -> Iterator[tuple[Path, dict | None]]:
    """Every record file under the tuning directory with its body (None when broken)."""
    where = where or root()
    if where is None or not where.is_dir():
        return
    for sub in sorted(where.iterdir()):
        if not sub.is_dir():
            continue
        for path in sorted(sub.glob("*" + SUFFIX)):
            if path.name.startswith(cache.TMP_PREFIX):
                continue
            try:
                yield path, decode(path.read_bytes())
            except (OSError, ValueError):
                yield path, None
