"""Helpers for the cache tests: worker and CLI subprocesses on a temp cache, file systems.

(A uniquely named module rather than conftest.py, which other test directories have too.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kwker.runtime import cache

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = HERE / "cache_worker.py"
# Other engineers edit kwker/codegen while tests run, which re-keys the cache (by design); the
# worker processes of one test session all use the version computed here.
CODEGEN_VERSION = cache.codegen_version()


def child_env(cache_dir: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWKER_")}
    env.update(KWKER_CACHE_DIR=str(cache_dir), PYTHONPATH=f"{HERE}{os.pathsep}{REPO}",
               KWKER_TEST_CODEGEN_VERSION=CODEGEN_VERSION,
               KWKER_TUNE="off")  # the suite's pin (tests/conftest.py): nothing measured
    env.update(extra)
    return env


@dataclass
class Done:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> dict:
        try:
            return json.loads(self.stdout)  # the CLI's --json document
        except json.JSONDecodeError:
            return json.loads(self.stdout.strip().splitlines()[-1])  # a worker's last line

    @property
    def warnings(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("kwker:")]


def spawn(args: list[str], cache_dir: Path, env: dict | None = None, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=child_env(cache_dir, **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(proc: subprocess.Popen) -> Done:
    out, err = proc.communicate()
    return Done(proc.returncode, out, err)


def run_worker(cache_dir: Path, *ns: int, faults: tuple = (), env: dict | None = None,
               extra: tuple = ()) -> Done:
    """Run smoke kernels ``ns`` in a fresh process; it must succeed and compute correctly."""
    args = [str(WORKER), "run", *map(str, ns), *(f"--fault={f}" for f in faults), *extra]
    done = finish(spawn(args, cache_dir, env))
    assert done.code == 0, done.stderr
    assert done.json["ok"], "a kernel computed wrong results"
    return done


def run_cli(cache_dir: Path, *args: str, env: dict | None = None, plain: bool = False) -> Done:
    """``kwker-cache ARGS`` in a worker (smoke family as the generic specs, pinned codegen
    version), or ``plain``: exactly as installed."""
    cmd = ["-m", "cache_tools", *args] if plain else [str(WORKER), "cli", *args]
    return finish(spawn(cmd, cache_dir, env))


def entries(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "v1").glob("??/*.kwo") if not p.name.startswith("."))


def temps(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "v1").glob("??/.tmp-*"))


def entry_for(cache_dir: Path, key: str) -> Path:
    return cache_dir / "v1" / key[:2] / f"{key}.kwo"


def remount_readonly(mnt: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)


def fill(mnt: Path) -> None:
    """Fill a file system until it has no byte left."""
    with open(mnt / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
