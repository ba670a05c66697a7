"""A process for the cache fault tests: runs smoke kernels (``run``) or the CLI (``cli``).

    python cache_worker.py run N [N ...] [--fault F] [--barrier DIR] [--umask M]
    python cache_worker.py cli [kwker-cache args]   (generic specs = smoke specs 1..4)

KWKER_TEST_CODEGEN_VERSION pins the codegen version (see cache_helpers.py); KWKER_TEST_FAULTS
(comma-separated) injects faults in both modes.

``run`` prints one JSON line: {"ok", "hits", "misses", "keys"}. Faults are injected here, in
the child, because the real mechanisms need a root mount (the tests use one when they can):

- ``enospc``: every write of cache data fails with ENOSPC (a full disk);
- ``erofs``: every write under KWKER_CACHE_DIR fails with EROFS (a read-only file system);
- ``kill-mid-write:FILE``: the first entry write stops half-way, creates FILE and sleeps until
  the test kills the process;
- ``version:V``: this process is Kwker codegen version V (an older or newer release).
"""
from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import shutil
import sys
import time

import kwsmoke

from kwker.runtime import cache


def inject(fault: str) -> None:
    kind, _, arg = fault.partition(":")
    if kind == "enospc":
        def full(f, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        cache._write = full
    elif kind == "erofs":
        base = os.path.realpath(os.environ["KWKER_CACHE_DIR"])

        def guard(fn, writes):
            def wrapped(path, *a, **k):
                p = os.path.realpath(os.fspath(path)) if not isinstance(path, int) else ""
                if p.startswith(base) and writes(a, k):
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))
                return fn(path, *a, **k)
            return wrapped
        wr = os.O_WRONLY | os.O_RDWR | os.O_CREAT
        os.open = guard(os.open, lambda a, k: bool(a and a[0] & wr))
        for name in ("mkdir", "unlink", "utime", "rmdir"):
            setattr(os, name, guard(getattr(os, name), lambda a, k: True))
        os.replace = guard(os.replace, lambda a, k: True)
    elif kind == "kill-mid-write":
        def half(f, data):
            f.write(data[:len(data) // 2])
            f.flush()
            open(arg, "w").close()
            time.sleep(3600)
        cache._write = half
    elif kind == "version":
        cache.codegen_version = lambda: arg
    else:
        raise SystemExit(f"unknown fault {fault}")


def barrier(folder: str) -> None:
    """Start compiling only when every worker has imported everything."""
    open(os.path.join(folder, f"ready-{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.005)


def main() -> int:
    if os.environ.get("KWKER_TEST_CODEGEN_VERSION"):
        inject("version:" + os.environ["KWKER_TEST_CODEGEN_VERSION"])
    for fault in filter(None, os.environ.get("KWKER_TEST_FAULTS", "").split(",")):
        inject(fault)
    if sys.argv[1] == "cli":
        from cache_tools.cli import main as cli_main
        from kwker import eager_specs

        eager_specs.generic_specs = lambda: [kwsmoke.CacheSmokeSpec(n) for n in range(1, 5)]
        return cli_main(sys.argv[2:])
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["run"])
    p.add_argument("ns", type=int, nargs="+")
    p.add_argument("--fault", action="append", default=[])
    p.add_argument("--barrier")
    p.add_argument("--umask", type=lambda s: int(s, 8))
    p.add_argument("--wipe-after", type=int, help="delete the cache dir after this many kernels")
    args = p.parse_args()
    if os.environ.get("KWKER_DEBUG"):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.umask is not None:
        os.umask(args.umask)
    for fault in args.fault:
        inject(fault)
    from kwker.runtime import kernel
    from kwker.runtime.target import host_target
    if args.barrier:
        barrier(args.barrier)
    ok = True
    for i, n in enumerate(args.ns):
        if i == args.wipe_after:
            shutil.rmtree(os.environ["KWKER_CACHE_DIR"])
        ok &= kwsmoke.run(n)
    keys = {n: cache.entry_key(kwsmoke.CacheSmokeSpec(n).id, host_target()) for n in args.ns}
    print(json.dumps({"ok": ok, "hits": kernel.stats["hits"], "misses": kernel.stats["misses"],
                      "keys": keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
