import pytest
import torch

import kwker.ops.sorting as sorting
from kwker.ops import rows


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """Let the row kernels take every size (no small-input hand-off to ATen), and count calls."""
    monkeypatch.setattr(sorting, "MIN_NUMEL", dict.fromkeys(sorting.MIN_NUMEL, 0))
    monkeypatch.setattr(sorting, "MIN_ROW", dict.fromkeys(sorting.MIN_ROW, 0))
    before = sum(rows.calls.values())
    yield rows.calls
    assert sum(rows.calls.values()) > before, "no Kwker kernel ran"


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
