"""Fixtures for the StableLM tests: tiny random StableLM checkpoints (built once per session) and the oracle tests'
harness (cvllm.testing's)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from cvllm.testing import (
    CheckpointFactory,
    checkpoint_factory,
    make_partial_rotary_checkpoint,
    register_tiny_architecture,
    save_sharded,
)
from cvllm.testing.fixtures import harness, one_torch_thread  # noqa: F401 (the fixtures, found here by pytest)

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# head_dim 16 (hidden 64 / 4 heads): the default partial rotary (0.25) turns 4 features a head
register_tiny_architecture("stablelm", "StableLmConfig", "StableLmForCausalLM")


def _randomize_per_head_norms(model: Any, path: Path, shards: int) -> None:
    """make_checkpoint randomises weights named ``*norm.weight``; the per-head q/k norms (``norms.{h}.weight``)
    start at 1 like a skipped load or one weight shared by all heads would: give each head its own, save again."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "layernorm.norms." in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
    config = (path / "config.json").read_text()   # save_pretrained rewrites it in transformers' spelling
    save_sharded(model, path, shards)
    (path / "config.json").write_text(config)


def make_stablelm_checkpoint(path: Path, rotary: str = "hub", **kwargs: Any) -> Any:
    model = make_partial_rotary_checkpoint(path, "stablelm", rotary, **kwargs)
    if kwargs.get("qk_layernorm"):
        _randomize_per_head_norms(model, path, kwargs.get("shards", 1))
    return model


@pytest.fixture(scope="session")
def stablelm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``stablelm_checkpoint(rotary=..., shards=..., **config_overrides)``, cached. ``rotary``: how config.json
    names the rotary fraction (ROTARY_SPELLINGS); "hub" as Stability AI publish it, "absent" leaves transformers'
    StableLmConfig at its default 0.25."""
    return checkpoint_factory(tmp_path_factory, make_stablelm_checkpoint)
