"""Fixtures for the Gemma tests: tiny random Gemma, Gemma 2, Gemma 3 and Gemma 3 multimodal checkpoints (built once
per session, in the spellings the hub and transformers 5 write), and the oracle tests' harness (cvllm.testing's)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from cvllm.testing import CheckpointFactory, checkpoint_factory, make_checkpoint
from cvllm.testing.fixtures import harness, one_torch_thread  # noqa: F401 (the fixtures, found here by pytest)
from cvllm_gemma.testing import gemma3_published, legacy_gelu, make_multimodal_checkpoint, register_tiny_gemmas

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
register_tiny_gemmas()


def make_gemma_checkpoint(path: Path, arch: str, **kwargs: Any) -> Any:
    if arch == "gemma3_multimodal":
        return make_multimodal_checkpoint(path, **kwargs)
    if arch == "gemma3" and kwargs.get("spelling") == "published":
        model = make_checkpoint(path, arch, **{**kwargs, "spelling": "v5"})
        gemma3_published(path)
        return model
    model = make_checkpoint(path, arch, **kwargs)
    if arch == "gemma" and kwargs.get("spelling", "published") == "published":
        legacy_gelu(path)
    return model


@pytest.fixture(scope="session")
def gemma_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``gemma_checkpoint(arch, spelling=..., **config_overrides)``, cached. ``arch``: gemma, gemma2, gemma3
    (``spelling="published"`` rewritten here: core's rewrite knows one rope only) or gemma3_multimodal
    (``layout=...``, ``spelling=...``)."""
    return checkpoint_factory(tmp_path_factory, make_gemma_checkpoint)
