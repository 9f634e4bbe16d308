"""Fixtures for the GLM tests: tiny random GLM-4 / GLM-4-0414 checkpoints (built once per session) and the oracle
tests' harness (cvllm.testing's)."""

from __future__ import annotations

import os

import pytest

from cvllm.testing import (
    CheckpointFactory,
    checkpoint_factory,
    make_partial_rotary_checkpoint,
    register_tiny_architecture,
)
from cvllm.testing.fixtures import harness, one_torch_thread  # noqa: F401 (the fixtures, found here by pytest)

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# head_dim 16 (transformers' GLM default is 128): partial rotary turns 8 features a head, 4 pairs
register_tiny_architecture("glm", "GlmConfig", "GlmForCausalLM", head_dim=16)
register_tiny_architecture("glm4", "Glm4Config", "Glm4ForCausalLM", head_dim=16)


@pytest.fixture(scope="session")
def glm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``glm_checkpoint(arch, rotary=..., shards=..., **config_overrides)``, cached. ``rotary``: how config.json
    names the rotary fraction (ROTARY_SPELLINGS); "hub" as THUDM/zai-org publish it, "absent" leaves transformers'
    GLM configs at their default 0.5."""
    return checkpoint_factory(tmp_path_factory, make_partial_rotary_checkpoint)
