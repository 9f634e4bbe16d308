"""Fixtures for the Llama/Mistral oracle tests: tiny checkpoints, each built once per session."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cvllm.testing.threads import one_torch_thread as _one_torch_thread

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))   # the tests' helper modules (speculation.py), under importlib mode


@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)
    tokenizer: Any  # transformers' AutoTokenizer loaded from the same directory


CheckpointFactory = Callable[..., TinyCheckpoint]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """`tiny_checkpoint(arch, spelling=..., shards=..., **config_overrides)`, cached by its arguments."""
    from transformers import AutoTokenizer

    from cvllm.testing import make_checkpoint

    built: dict[str, TinyCheckpoint] = {}

    def build(arch: str = "llama", *, spelling: str = "published", shards: int = 1, **overrides: Any):
        key = json.dumps([arch, spelling, shards, overrides], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{spelling}-{len(built)}")
            model = make_checkpoint(path, arch, spelling=spelling, shards=shards, **overrides)
            built[key] = TinyCheckpoint(path, model, AutoTokenizer.from_pretrained(path))
        return built[key]

    return build


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models are all per-op overhead: a second OpenMP thread only spins (5x slower on a busy machine)."""
    with _one_torch_thread():
        yield
