import pytest
import torch

from kwker.runtime import tile_permission
from kwker.runtime.target import host_target


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    torch.set_num_threads(request.param)
    return request.param


@pytest.fixture
def native_tiles():
    """Skip, with the reason, where tile kernels cannot run natively (no AMX-BF16, or Linux
    refused the tile state); the emulated target covers their logic there."""
    if host_target().tiles != "amx":
        pytest.skip("no native tile runs: " + (tile_permission.refusal() or
                    f"this CPU ({host_target().describe()}) has no AMX-BF16"))
