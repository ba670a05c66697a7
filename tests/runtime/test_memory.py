"""Freed heap goes back to the OS after a graph is compiled (kwker/runtime/memory.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import kwker.dynamo as kd
from kwker.runtime import memory

WORKER = textwrap.dedent("""
    import sys
    from kwker.runtime.memory import release_free_heap

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024

    blocks = [bytes(1000) + bytes([i % 256]) for i in range(200_000)]  # malloc'd, not pymalloc
    keep = blocks[::64]  # freed blocks between kept ones: free's own trimming cannot take them
    del blocks
    before = rss_mb()
    release_free_heap()
    print(before - rss_mb())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    memory.libc_function("malloc_trim") is None, reason="malloc_trim is glibc's")
def test_freed_blocks_leave_the_rss():
    freed = float(subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True,
                                 check=True).stdout)
    assert freed > 100  # of the ~200 MB freed


def test_each_compiled_graph_releases_the_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(kd, "release_free_heap", lambda: calls.append(1))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU())
    torch._dynamo.reset()
    for inner in ("eager", "inductor"):
        fast = torch.compile(model, backend="kwker", options={"inner": inner})
        with torch.no_grad():
            fast(torch.randn(4, 32))
        torch._dynamo.reset()
    assert len(calls) == 2
