"""What is in the kernel cache, what is wrong with it, and removing entries.

Everything here reads headers only (never loads object code), so it is safe on a cache that
Kwker itself refuses to load from.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kwker.runtime import cache, tile_permission, tuning
from kwker.runtime.target import Target, host_target


class CacheProblem(Exception):
    """A problem the CLI reports as its one-line reason (exit status 1)."""


def cache_dir() -> Path:
    """``<KWKER_CACHE_DIR>/v1`` even when the cache is switched off (the CLI still manages it)."""
    return cache.base_dir() / cache.LAYOUT


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def diagnose(root: Path, write_probe: bool = True) -> tuple[str, str | None]:
    """(status, problem): status is ok, missing, disabled or unusable."""
    if os.environ.get("KWKER_CACHE", "1") == "0":
        return "disabled", "the kernel cache is switched off (KWKER_CACHE=0)"
    try:
        cache.check_root(root)
    except FileNotFoundError:
        anchor = _nearest_existing(root)
        if not anchor.is_dir():
            return "unusable", (f"cache path {anchor} is not a directory "
                                "(check KWKER_CACHE_DIR)")
        if not os.access(anchor, os.W_OK | os.X_OK):
            return "unusable", (f"cannot create cache directory {root}: {anchor} is read-only "
                                "or not writable")
        return "missing", None
    except cache.UnusableCache as e:
        return "unusable", str(e)
    except OSError as e:
        return "unusable", f"cannot read cache directory {root}: {e.strerror}"
    if not os.access(root, os.R_OK | os.X_OK):
        return "unusable", f"cannot read cache directory {root}"
    if write_probe:
        try:
            cache.probe_writable(root)
        except cache.UnusableCache as e:
            return "unusable", str(e)
    return "ok", None


@dataclass
class Item:
    """One entry as the CLI shows it."""
    key: str
    path: str
    size: int
    last_use: float
    status: str  # current, other target, other version, bad
    family: str = "?"
    symbol: str = "?"
    dtype: str = "-"
    shapes: str = "-"
    target: str = "?"
    created: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _describe_spec(spec: dict) -> tuple[str, str]:
    """(dtype, shapes) of a spec's JSON: sizes are its int and tuple fields."""
    dtype = spec.get("dtype") or spec.get("dtypes") or "-"
    if isinstance(dtype, list):
        dtype = ",".join(map(str, dtype))
    shapes = []
    for name, v in spec.items():
        if isinstance(v, bool) or name in ("family", "dtype", "dtypes"):
            continue
        if isinstance(v, int):
            shapes.append(f"{name}={v}")
        elif isinstance(v, list) and all(isinstance(x, int) for x in v):
            shapes.append(f"{name}={'x'.join(map(str, v)) or '()'}")
    return str(dtype), " ".join(shapes) or "-"


def classify(header: dict, target: Target, versions: dict) -> str:
    if header.get("target") != asdict(target):
        return "other target"
    if any(header.get(k) != v for k, v in versions.items()):
        return "other version"
    return "current"


def scan(root: Path) -> list[Item]:
    """Every entry under ``root`` with its header's description."""
    target, versions = host_target(), cache.versions()
    items = []
    for e in cache.iter_entries(root):
        item = Item(e.key, str(e.path), e.size, e.mtime, "bad")
        try:
            header = cache.read_header(e.path)
        except (OSError, ValueError):
            items.append(item)
            continue
        spec = header.get("spec") if isinstance(header.get("spec"), dict) else {}
        item.family = str(spec.get("family", "?"))
        item.symbol = str(header.get("symbol", "?"))
        item.dtype, item.shapes = _describe_spec(spec)
        t = header.get("target") if isinstance(header.get("target"), dict) else {}
        item.target = str(t.get("cpu", "?"))
        item.created = header.get("created")
        item.status = classify(header, target, versions)
        items.append(item)
    return items


@dataclass
class Record:
    """One tuning record (kwker/runtime/tuning.py) as the CLI shows it."""
    path: str
    status: str  # current, other target, other version, bad
    op: str = "?"
    choice: str = "?"
    times_us: dict | None = None  # candidate -> best time measured
    inputs: str = "-"
    target: str = "?"
    threads: int | None = None
    created: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _describe_inputs(problem: str) -> str:
    """The shapes and dtypes of a record's problem, as ``64x256 float32, ...``."""
    try:
        inputs = json.loads(problem).get("inputs", [])
        return ", ".join("x".join(map(str, t[1])) + " " + str(t[3]).replace("torch.", "")
                         for t in inputs) or "-"
    except (ValueError, AttributeError, IndexError, TypeError):
        return "?"


def scan_tuning(root: Path) -> list[Record]:
    """Every tuning record under ``root``; a record of this CPU with other versions (or of
    another CPU) is stale: it will never be used here again."""
    target, versions = host_target(), {"tuning": tuning.tuning_version(), **cache.versions()}
    records = []
    for path, body in tuning.iter_records(root / tuning.DIR):
        rec = Record(str(path), "bad", created=path.stat().st_mtime if path.exists() else 0.0)
        if body is not None:
            times = body.get("times_us") or {}
            t = body.get("target") if isinstance(body.get("target"), dict) else {}
            choice = str(body.get("choice", "?"))
            if isinstance(body.get("thresholds"), dict):  # the drop-in's (min numel/min row)
                choice = ", ".join(f"{f} {v[0]}/{v[1]}" for f, v in body["thresholds"].items())
            rec = Record(str(path), classify(body, target, versions), str(body.get("op", "?")),
                         choice, dict(times),
                         _describe_inputs(str(body.get("problem", ""))), str(t.get("cpu", "?")),
                         body.get("threads"), float(body.get("created", 0.0)))
        records.append(rec)
    return records


def clear_tuning(root: Path, mode: str, age: float | None = None,
                 dry_run: bool = False) -> tuple[list[Record], list[str]]:
    """Remove tuning records: mode all, stale or older (measured more than ``age`` ago)."""
    now = time.time()
    chosen = [r for r in scan_tuning(root)
              if mode in ("all", "tuning") or (mode == "stale" and r.status != "current")
              or (mode == "older" and now - r.created > age)]
    if dry_run:
        return chosen, []
    errors: list[str] = []
    return [r for r in chosen if _unlink(Path(r.path), errors)], errors


def free_bytes(root: Path) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(_nearest_existing(root)).free
    return None


def info(root: Path) -> tuple[dict, str | None]:
    status, problem = diagnose(root)
    items = scan(root) if status in ("ok", "unusable", "disabled") and root.is_dir() else []
    target = host_target()
    records = scan_tuning(root) if root.is_dir() else []
    counts = {s: sum(i.status == s for i in items)
              for s in ("current", "other target", "other version", "bad")}
    report = {
        "cache_dir": str(root), "status": status, "problem": problem,
        "entries": len(items), "bytes": sum(i.size for i in items),
        "limit_bytes": cache.max_bytes(), "free_bytes": free_bytes(root),
        "current": counts["current"], "other_target": counts["other target"],
        "other_version": counts["other version"], "bad": counts["bad"],
        "temp_files": sum(1 for _ in cache.iter_temps(root)) if root.is_dir() else 0,
        "target": {**asdict(target), "description": target.describe(),
                   "tile_refusal": tile_permission.refusal()},
        "versions": cache.versions(),
        "tuning_mode": os.environ.get("KWKER_TUNE", "on"),
        "tuning_records": {s: sum(r.status == s for r in records)
                           for s in ("current", "other target", "other version", "bad")},
    }
    return report, problem if status != "disabled" else None


def parse_age(text: str) -> float:
    """'30s', '15m', '12h', '7d', '2w' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    t = text.strip().lower()
    try:
        if t and t[-1] in units:
            value = float(t[:-1])
            if value >= 0:
                return value * units[t[-1]]
    except ValueError:
        pass
    raise ValueError(f"not an age: {text!r} (use e.g. 30m, 12h, 7d or 2w)")


def _unlink(path: Path, errors: list[str]) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        errors.append(f"cannot remove {path}: {e.strerror}")
        return False


def _tidy_key(root: Path, key: str, live: bool, errors: list[str]) -> None:
    """Remove a key's leftover temp files, and its lock file if the entry is gone, while holding
    its lock: a writer holds the lock, and a waiter re-checks the lock's inode after flock."""
    path = cache.lock_path(root, key)
    try:
        fd = cache.try_lock(path)
    except OSError:
        return
    if fd is None:
        return  # being written right now
    try:
        for tmp in cache.entry_path(root, key).parent.glob(f"{cache.TMP_PREFIX}{key}-*"):
            _unlink(tmp, errors)
        if not live:
            _unlink(path, errors)
    finally:
        os.close(fd)


def clear(root: Path, mode: str, age: float | None = None,
          dry_run: bool = False) -> tuple[list[Item], list[str]]:
    """Remove entries: mode all, stale (other target/version, bad) or older (last use > age).
    Returns (removed items, errors). Leftover temp files and idle lock files go too."""
    now = time.time()
    chosen = []
    for item in scan(root):
        if (mode == "all" or (mode == "stale" and item.status != "current")
                or (mode == "older" and now - item.last_use > age)):
            chosen.append(item)
    if dry_run:
        return chosen, []
    removed, errors = [], []
    for item in chosen:
        if _unlink(Path(item.path), errors):
            removed.append(item)
    live = {e.key for e in cache.iter_entries(root)}
    keys = {tmp.name[len(cache.TMP_PREFIX):].split("-", 1)[0] for tmp in cache.iter_temps(root)}
    lock_dir = root / cache.LOCK_DIR
    if lock_dir.is_dir():
        keys.update(lock.stem for lock in lock_dir.glob("*.lock") if lock.stem not in live)
    for key in sorted(keys):
        _tidy_key(root, key, key in live, errors)
    for probe in root.glob(f"{cache.TMP_PREFIX}probe-*"):
        if now - probe.stat().st_mtime > 60:  # a killed `kwker-cache info`
            _unlink(probe, errors)
    return removed, errors
