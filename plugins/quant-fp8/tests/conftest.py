"""Without a GPU the FP8 plane kernels (cvllm_cuda.kernels.quant_matmul) run in Triton's CPU interpreter: Triton
reads TRITON_INTERPRET when the kernels module is first imported, so it is set here, before any test imports it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))   # fp8_checkpoints.py, under --import-mode=importlib

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cvllm.testing.threads import one_torch_thread as single_torch_thread  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    with single_torch_thread():
        yield
