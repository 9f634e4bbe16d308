"""Tiny random DeepSeek checkpoints (built once per session) and one torch thread per module."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# without a GPU the CUDA backend's low-bit kernels run in Triton's interpreter (read when they are first imported)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cvllm.testing.checkpoints import make_checkpoint  # noqa: E402
from cvllm.testing.threads import one_torch_thread as _one_torch_thread  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")   # everything the tests load is on disk


@pytest.fixture(scope="session")
def deepseek_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """``deepseek_checkpoint(arch, **config_overrides)`` -> (path, the transformers model), cached."""
    built: dict[str, tuple[Path, Any]] = {}

    def build(arch: str, **kwargs: Any) -> tuple[Path, Any]:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{len(built)}")
            built[key] = (path, make_checkpoint(path, arch, **kwargs))
        return built[key]

    return build


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    with _one_torch_thread():
        yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")
    # triton 3.6's interpreter converts 1-element arrays to ints the way numpy deprecated
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
