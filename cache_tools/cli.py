"""``kwker-cache``: inspect, fill and empty Kwker's kernel cache.

    kwker-cache info                  where it is, what is in it, this machine's target
    kwker-cache list                  entries: family, dtype, shapes, size, last use
    kwker-cache prewarm [--manifest FILE | --package FILE] [--jobs N]
    kwker-cache tuning [--stale]      measured choices: op, sizes, winner, times, CPU
    kwker-cache clear [--stale | --older-than AGE | --tuning] [--dry-run]

Every command takes ``--json`` (machine-readable stdout) and ``--cache-dir DIR`` (instead of
KWKER_CACHE_DIR). A failure exits with status 1 and one line on stderr saying why; usage errors
exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from . import inventory

PROG = "kwker-cache"


class Failure(Exception):
    """Ends the command with status 1; the message is the one-line reason."""


def human(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def ago(t: float, now: float) -> str:
    s = max(0.0, now - t)
    for unit, secs in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= secs:
            return f"{s / secs:.0f} {unit} ago"
    return "just now"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*r).rstrip() for r in [header] + rows)


# --- commands ------------------------------------------------------------------------------------

def cmd_info(args, out: dict) -> str | None:
    root = inventory.cache_dir()
    report, problem = inventory.info(root)
    out.update(report)
    if not args.json:
        t, v = report["target"], report["versions"]
        limit = human(report["limit_bytes"]) if report["limit_bytes"] else "none"
        print(f"cache directory  {report['cache_dir']}")
        print(f"status           {report['status']}" + (f": {problem}" if problem else ""))
        print(f"entries          {report['entries']} ({human(report['bytes'])}); size limit "
              f"{limit} (KWKER_CACHE_MAX_BYTES); {human(report['free_bytes'])} free on disk")
        print(f"  this machine   {report['current']}")
        print(f"  other target   {report['other_target']}")
        print(f"  other version  {report['other_version']}")
        print(f"  unreadable     {report['bad']}")
        print(f"this machine     {t['description']}, {t['triple']}")
        print(f"  CPU name       {t['cpu']}")
        print(f"  features       {t['features'] or '(implied by the CPU name)'}")
        tiles = {"amx": "AMX tile unit", "emulated": "emulated with AVX-512 (KWKER_TILES)"}
        print(f"  matrix tiles   {tiles.get(t['tiles'], 'not used')}"
              + (f" ({t['tile_refusal']})" if t["tile_refusal"] else ""))
        print(f"versions         kwker {v['kwker']}, llvmlite {v['llvmlite']}, LLVM {v['llvm']}")
        r = report["tuning_records"]
        print(f"tuning records   {sum(r.values())}: {r['current']} for this machine, "
              f"{r['other target'] + r['other version']} stale, {r['bad']} unreadable "
              f"(KWKER_TUNE={report['tuning_mode']})")
    return problem


def cmd_tuning(args, out: dict) -> str | None:
    root = inventory.cache_dir()
    records = inventory.scan_tuning(root) if root.is_dir() else []
    if args.stale:
        records = [r for r in records if r.status != "current"]
    records.sort(key=lambda r: (r.op, r.inputs))
    out["cache_dir"] = str(root)
    out["records"] = [r.to_json() for r in records]
    if not args.json:
        rows = [[r.op, r.inputs, r.choice,
                 ", ".join(f"{k} {v:g}" for k, v in (r.times_us or {}).items()) or "-",
                 f"{r.target}/{r.threads}t", r.status] for r in records]
        if rows:
            print(table(rows, ["OP", "INPUTS", "CHOICE", "TIMES (us)", "CPU/THREADS",
                               "STATUS"]))
        print(f"{len(records)} tuning records in {root / 'tuning'}")
    return None


def cmd_list(args, out: dict) -> str | None:
    root = inventory.cache_dir()
    status, problem = inventory.diagnose(root, write_probe=False)
    if status == "unusable" and not root.is_dir():
        raise Failure(problem)
    if problem and status != "disabled":
        print(f"{PROG}: warning: {problem}", file=sys.stderr)
    items = inventory.scan(root) if root.is_dir() else []
    key = {"last-use": lambda i: -i.last_use, "size": lambda i: -i.size,
           "family": lambda i: (i.family, i.symbol)}[args.sort]
    items.sort(key=key)
    if args.stale:
        items = [i for i in items if i.status != "current"]
    out["cache_dir"] = str(root)
    out["entries"] = [i.to_json() for i in items]
    if not args.json:
        now = time.time()
        rows = [[i.family, i.symbol, i.dtype, i.shapes, human(i.size), ago(i.last_use, now),
                 i.status if i.status != "other target" else f"other target ({i.target})"]
                for i in items]
        if rows:
            print(table(rows, ["FAMILY", "KERNEL", "DTYPE", "SHAPES", "SIZE", "LAST USE",
                               "STATUS"]))
        total = sum(i.size for i in items)
        print(f"{len(items)} entries, {human(total)} in {root}")
    return None


def cmd_prewarm(args, out: dict) -> str | None:
    from kwker.runtime.target import host_target

    from . import prewarm

    root = inventory.cache_dir()
    _, problem = inventory.diagnose(root)
    if problem:
        raise Failure(f"cannot prewarm: {problem}")
    if args.manifest:
        from kwker.runtime.manifest import ManifestError, read_manifest
        try:
            specs = read_manifest(args.manifest)
        except ManifestError as e:
            raise Failure(str(e)) from None
        source = f"manifest {args.manifest}"
    elif args.package:
        from kwker.packaging import PackageError, package_specs
        try:
            specs = package_specs(args.package)
        except PackageError as e:
            raise Failure(str(e)) from None
        source = f"package {args.package}"
    else:
        from kwker import eager_specs
        specs = eager_specs.generic_specs()
        source = "the generic eager specialisations"
    jobs = max(1, min(args.jobs or prewarm.default_jobs(), len(specs)))
    target = host_target()
    t0 = time.perf_counter()
    results = prewarm.prewarm(specs, jobs, None if args.json else args.progress)
    tuned = thresholds = None
    if args.package and not args.no_tune:
        tuned = prewarm.tune_package(args.package)
    elif not args.manifest and not args.no_tune:
        thresholds = prewarm.tune_drop_in()
    failed = [r for r in results if r.status == "failed"]
    counts = {s: sum(r.status == s for r in results) for s in ("compiled", "cached", "failed")}
    out.update(cache_dir=str(root), target=target.describe(), source=source, jobs=jobs,
               seconds=round(time.perf_counter() - t0, 3), **counts,
               kernels=[r.__dict__ for r in results], tuning_records=tuned,
               drop_in_thresholds=thresholds)
    if not args.json:
        for r in failed:
            print(f"failed: {r.symbol}: {r.error}", file=sys.stderr)
        print(f"prewarmed {len(results)} kernels from {source} for {target.describe()} into "
              f"{root}: {counts['compiled']} compiled, {counts['cached']} already cached, "
              f"{counts['failed']} failed ({out['seconds']:.1f} s, {jobs} jobs)")
        if tuned is not None:
            print(f"tuning: {tuned} records for this machine hold the package's choices "
                  "(kwker-cache tuning lists them)")
        if thresholds:
            print("drop-in size thresholds measured here (min elements / min row length): "
                  + ", ".join(f"{f} {n}/{r}" for f, (n, r) in thresholds.items()))
    if failed:
        return (f"{len(failed)} of {len(results)} kernels failed (first: {failed[0].symbol}: "
                f"{failed[0].error})")
    return None


def cmd_clear(args, out: dict) -> str | None:
    root = inventory.cache_dir()
    status, problem = inventory.diagnose(root, write_probe=False)
    if status == "unusable" and not root.is_dir():
        raise Failure(problem)
    mode, age = "all", None
    if args.stale:
        mode = "stale"
    elif args.older_than:
        mode, age = "older", inventory.parse_age(args.older_than)
    elif args.tuning:
        mode = "tuning"
    removed, errors = ([], [])
    if root.is_dir() and mode != "tuning":
        removed, errors = inventory.clear(root, mode, age, args.dry_run)
    records, rec_errors = (inventory.clear_tuning(root, mode, age, args.dry_run)
                           if root.is_dir() else ([], []))
    errors += rec_errors
    total = sum(i.size for i in removed)
    out.update(cache_dir=str(root), mode=mode, dry_run=args.dry_run, removed_bytes=total,
               removed=[i.to_json() for i in removed], errors=errors,
               removed_records=[r.to_json() for r in records])
    if not args.json:
        verb = "would remove" if args.dry_run else "removed"
        for i in removed:
            print(f"{verb} {i.family} {i.symbol} ({i.status}, {human(i.size)})")
        for r in records:
            print(f"{verb} tuning record {r.op} {r.inputs} ({r.status})")
        print(f"{verb} {len(removed)} entries, {human(total)}, and {len(records)} tuning "
              f"records from {root}")
    if errors:
        return f"{len(errors)} files could not be removed (first: {errors[0]})"
    return None


# --- parsing -------------------------------------------------------------------------------------

def _age(text: str) -> str:
    try:
        inventory.parse_age(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"not a number of jobs: {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from kwker import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON on stdout (for scripts)")
    common.add_argument("--cache-dir", metavar="DIR",
                        help="cache directory to use instead of KWKER_CACHE_DIR / the default")
    p = argparse.ArgumentParser(prog=PROG, description="Manage Kwker's on-disk kernel cache.",
                                epilog="Environment: KWKER_CACHE_DIR, KWKER_CACHE=0, "
                                       "KWKER_CACHE_MAX_BYTES (default 1G), KWKER_CPU, "
                                       "KWKER_FEATURES, KWKER_TUNE (on, off, force).")
    p.add_argument("--version", action="version", version=f"kwker {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("info", parents=[common], help="location, size, this machine's target",
                       description="Show where the cache is, how many entries it holds and how "
                       "many belong to other CPUs or versions, this machine's target and the "
                       "Kwker/LLVM versions. Exits 1 if the cache cannot be used.")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("list", parents=[common], help="list entries",
                       description="List entries with kernel family, dtype, shapes, size, last "
                       "use and whether they belong to this machine.")
    s.add_argument("--sort", choices=("last-use", "size", "family"), default="last-use")
    s.add_argument("--stale", action="store_true",
                   help="only entries for other targets/versions or unreadable ones")
    s.set_defaults(func=cmd_list)

    s = sub.add_parser("prewarm", parents=[common], help="compile kernels ahead of time",
                       description="Compile the generic eager specialisations (or the kernels "
                       "of a manifest written for a compiled model) for this machine's CPU, so "
                       "later processes start warm.")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--manifest", metavar="FILE", help="compile the specs recorded in FILE")
    which.add_argument("--package", metavar="FILE",
                       help="compile the kernels of the package FILE (kwker.package) for this "
                       "CPU, so loading it here compiles nothing")
    s.add_argument("--no-tune", action="store_true",
                   help="only compile: do not measure the drop-in ops' size thresholds (the "
                   "default prewarm) or a package's choices (kernel or ATen per op) here")
    s.add_argument("--jobs", "-j", type=_jobs, default=0, metavar="N",
                   help="parallel compile processes (default: one per CPU)")
    bar = s.add_mutually_exclusive_group()
    bar.add_argument("--progress", action="store_true", default=None,
                     help="always show the progress bar (default: only on a terminal)")
    bar.add_argument("--no-progress", dest="progress", action="store_false")
    s.set_defaults(func=cmd_prewarm)

    s = sub.add_parser("tuning", parents=[common], help="list tuning records",
                       description="List the choices measured on this machine (kernel or ATen, "
                       "per op and sizes) with their times, the CPU and thread count they were "
                       "measured for, and whether they still apply here.")
    s.add_argument("--stale", action="store_true",
                   help="only records of other CPUs or versions, and unreadable ones")
    s.set_defaults(func=cmd_tuning)

    s = sub.add_parser("clear", parents=[common], help="remove entries (all by default)",
                       description="Remove all entries and tuning records, only stale ones, ones "
                       "not used for a while, or only the tuning records, and report what was "
                       "removed.")
    which = s.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="every entry (the default)")
    which.add_argument("--stale", action="store_true",
                       help="entries for other CPUs or Kwker/LLVM versions, and unreadable ones")
    which.add_argument("--older-than", type=_age, metavar="AGE",
                       help="entries not used for AGE (e.g. 12h, 7d, 2w)")
    which.add_argument("--tuning", action="store_true",
                       help="only the tuning records (measured again on next use)")
    s.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    s.set_defaults(func=cmd_clear)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return 2
    if args.cache_dir:
        os.environ["KWKER_CACHE_DIR"] = str(Path(args.cache_dir).expanduser())
    logging.basicConfig(format="%(message)s",
                        level=logging.INFO if os.environ.get("KWKER_DEBUG") else logging.WARNING)
    out: dict = {"command": args.command}
    try:
        problem = args.func(args, out)
    except (Failure, ValueError) as e:
        problem = str(e)
    except Exception as e:  # one line for users; the traceback when debugging
        if os.environ.get("KWKER_DEBUG"):
            traceback.print_exc()
        problem = f"{type(e).__name__}: {e}"
    if args.json:
        out["error"] = problem
        print(json.dumps(out, indent=1, default=str))
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
