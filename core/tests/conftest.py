import pytest

from cvllm.testing.threads import one_torch_thread as _one_torch_thread


@pytest.fixture(scope="module")
def one_torch_thread():
    with _one_torch_thread():
        yield
