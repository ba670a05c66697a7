"""Fixtures for the cache tests (helpers are in cache_helpers.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def cache_dir(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def tmpfs(tmp_path):
    """``make(size)`` mounts a fresh tmpfs (skips where mounting is not allowed)."""
    mounted = []

    def make(size: str = "1m") -> Path:
        mnt = tmp_path / f"mnt{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                            str(mnt)], check=False, capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); "
                        "the simulated variant of this test covers the fault")
        mounted.append(mnt)
        return mnt

    yield make
    for mnt in reversed(mounted):
        subprocess.run(["umount", "-l", str(mnt)], check=False)
