"""The AVX2 and SSE code paths run and agree with torch (this host runs both ISAs' code)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kwker.runtime.target import host_target

WORKER = Path(__file__).with_name("avx2_worker.py")
ISAS = {
    "avx2": ("haswell", "+avx,+avx2,+fma,-avx512f,-avx512bw,-avx512vl,-avx512dq", "AVX2"),
    "sse": ("x86-64-v2", "+sse4.2,-avx,-avx2,-fma,-avx512f", "SSE"),
}


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_factories_on_other_isa(isa, tmp_path):
    cpu, features, name = ISAS[isa]
    if isa == "avx2" and not host_target().has("avx2"):
        pytest.skip("host cannot run AVX2 code")
    env = dict(os.environ, KWKER_CPU=cpu, KWKER_FEATURES=features,
               KWKER_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"({name}" in r.stdout
