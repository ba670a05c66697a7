import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    torch.set_num_threads(request.param)
    return request.param
