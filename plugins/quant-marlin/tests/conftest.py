"""Makes the tests' reference (marlin_reference.py) importable and keeps torch to one thread on tiny tensors.

Without a GPU the plane kernels (cvllm_cuda.kernels.quant_matmul) run in Triton's CPU interpreter. Triton reads
TRITON_INTERPRET when a kernel is decorated, i.e. when the kernels module is first imported, so it is set here,
before any test module imports them (as plugins/backend-cuda/tests/conftest.py does)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from cvllm.testing.threads import one_torch_thread as single_torch_thread  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # triton 3.6's interpreter converts 1-element arrays to ints the way numpy deprecated: many per test
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    with single_torch_thread():
        yield
