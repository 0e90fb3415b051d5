import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The models here are tiny: intra-op threads only add contention on a shared 2-core runner
    # (measured ~10x slower steps with 2 threads while other tests run).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
