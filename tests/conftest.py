"""Choices pinned for the whole suite: the built-in ones, not measured (``KWKER_TUNE=off``);
and the fixture of native tile runs.

Measured choices depend on the machine and its load, so a test that counts lowered nodes would
pass on one run and fail on the next. The tuner's own tests (tests/integration/test_tuning.py)
switch it on with a private cache. Set before any test imports Kwker, and inherited by the
subprocesses tests start.
"""
import os

import pytest

os.environ.setdefault("KWKER_TUNE", "off")


@pytest.fixture
def native_tiles():
    """Skip, with the reason, where tile kernels cannot run natively (no AMX-BF16, or Linux
    refused the tile state); the emulated target covers their logic there."""
    from kwker.runtime import tile_permission
    from kwker.runtime.target import host_target
    if host_target().tiles != "amx":
        pytest.skip("no native tile runs: " + (tile_permission.refusal() or
                    f"this CPU ({host_target().describe()}) has no AMX-BF16"))
