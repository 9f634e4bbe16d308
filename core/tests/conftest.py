import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    # These tensors are tiny: intra-op threads only add scheduling overhead (large on a busy machine).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
