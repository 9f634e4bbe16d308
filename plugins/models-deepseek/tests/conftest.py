"""Tiny random DeepSeek checkpoints (built once per session) and one torch thread per module."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cvllm.testing.checkpoints import make_checkpoint
from cvllm.testing.threads import one_torch_thread as _one_torch_thread

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
