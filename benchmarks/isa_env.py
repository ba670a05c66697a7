"""Run a benchmark without AVX512_BF16: the environment it needs, set before torch is imported.

ATen reads ``ATEN_CPU_CAPABILITY`` and oneDNN ``ONEDNN_MAX_CPU_ISA`` once, when torch loads;
Kwker reads ``KWKER_CPU`` (a CPU name implies its features). So a script given ``--isa avx2``
re-executes itself with these set unless they already are. No torch import here.
"""
from __future__ import annotations

import os
import sys

AVX2_ENV = {"KWKER_CPU": "znver3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
ISA_ENVS = {"avx2": AVX2_ENV}


def wanted(argv: list[str]) -> str | None:
    """The ``--isa NAME`` of ``argv`` (``--isa=NAME`` too), or None."""
    for i, a in enumerate(argv):
        if a == "--isa" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--isa="):
            return a.split("=", 1)[1]
    return None


def ensure(argv: list[str]) -> None:
    """Re-execute this process with the ``--isa`` environment when it is not in place (call it
    before ``import torch``); an unknown ISA is left to argparse to reject."""
    env = ISA_ENVS.get(wanted(argv) or "")
    if env and any(os.environ.get(k) != v for k, v in env.items()):
        os.execve(sys.executable, [sys.executable, *argv], {**os.environ, **env})
