"""Tiny random DeepSeek checkpoints (built once per session) and one torch thread per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# without a GPU the CUDA backend's low-bit kernels run in Triton's interpreter (read when they are first imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cvllm.testing import checkpoint_factory  # noqa: E402
from cvllm.testing.threads import one_torch_thread as _one_torch_thread  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # everything the tests load is on disk


@pytest.fixture(scope="session")
def deepseek_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``deepseek_checkpoint(arch, **config_overrides)`` -> (path, the transformers model), cached."""
    checkpoints = checkpoint_factory(tmp_path_factory)

    def get(arch: str, **kwargs: Any) -> tuple[Path, Any]:
        checkpoint = checkpoints(arch, **kwargs)
        return checkpoint.path, checkpoint.model

    return get


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    with _one_torch_thread():
        yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # triton 3.6's interpreter converts 1-element arrays to ints the way numpy deprecated
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
