"""Fixtures for the Phi tests: tiny random Phi-2 and Phi-3 checkpoints (built once per session, config.json in the
published Phi layout), the oracle tests' harness (cvllm.testing's), and a per-position LongRoPE reference."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cvllm import plugins
from cvllm.testing import CheckpointFactory, TinyCheckpoint, checkpoint_factory
from cvllm.testing.checkpoints import make_checkpoint, register_tiny_architecture
from cvllm.testing.fixtures import harness, one_torch_thread  # noqa: F401 (the fixtures, found here by pytest)
from cvllm_phi import plugin

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Phi-2's shape at toy size: as many K/V heads as query heads, 40% of each head rotated (16 * 0.4 -> 6 dims)
register_tiny_architecture("phi", "PhiConfig", "PhiForCausalLM", num_key_value_heads=4, partial_rotary_factor=0.4,
                           hidden_act="gelu_new", layer_norm_eps=1e-5)
register_tiny_architecture("phi3", "Phi3Config", "Phi3ForCausalLM")


def published_phi_layout(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as Microsoft's Phi checkpoints spell it: ``partial_rotary_factor`` and
    ``original_max_position_embeddings`` at the top level, rope_scaling's ``type`` (``su`` kept as written),
    ``rope_scaling: null`` without scaling."""
    scaling = dict(raw.get("rope_scaling") or {})
    if "partial_rotary_factor" in scaling:
        raw["partial_rotary_factor"] = scaling.pop("partial_rotary_factor")
    original = scaling.pop("original_max_position_embeddings", None)
    if original is not None:
        raw.setdefault("original_max_position_embeddings", original)
    if scaling.get("rope_type", "default") == "default":
        raw["rope_scaling"] = None
    else:
        scaling["type"] = scaling.pop("rope_type")
        raw["rope_scaling"] = scaling
    return raw


def make_phi_checkpoint(path: Path, arch: str, spelling: str = "published", **overrides: Any) -> Any:
    # transformers' Phi3Config rejects "su"; it reads the same parameters as "longrope"
    rope = overrides.get("rope_parameters") or {}
    hf_overrides = {**overrides, "rope_parameters": {**rope, "rope_type": "longrope"}} \
        if rope.get("rope_type") == "su" else overrides
    model = make_checkpoint(path, arch, spelling="v5" if spelling == "v5" else "published", **hf_overrides)
    if spelling != "v5":
        config_path = path / "config.json"
        raw = published_phi_layout(json.loads(config_path.read_text()))
        if rope.get("rope_type") == "su":
            raw["rope_scaling"]["type"] = "su"
        config_path.write_text(json.dumps(raw, indent=2))
    return model


@pytest.fixture(scope="session")
def phi_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``phi_checkpoint(arch, spelling="published" | "v5", **config_overrides)``, cached per arguments."""
    return checkpoint_factory(tmp_path_factory, make_phi_checkpoint)


@pytest.fixture(autouse=True)
def phi_plugin_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin's hooks registered directly: the tests behave the same whether or not it is installed. The CUDA
    backend's too, where it is installed (the GPU tests run on it)."""
    monkeypatch.setenv("CVLLM_PLUGINS", "")
    plugins.reset_plugins()
    plugins.get_plugin_manager().register(plugin, name="phi")
    try:
        from cvllm_cuda import plugin as cuda_plugin
    except ImportError:
        cuda_plugin = None
    if cuda_plugin is not None:
        plugins.get_plugin_manager().register(cuda_plugin, name="cuda")
    yield
    plugins.reset_plugins()


# ---- a per-position LongRoPE reference: transformers' model with a rotary that picks factors per position ----


class PerPositionLongRope(torch.nn.Module):
    """transformers' Phi3RotaryEmbedding with cvllm's rule: short factors below the original context, long ones
    from there on, whatever else is in the pass. The factors and the scale come from transformers' own longrope
    init, so only the rule differs."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.original = rope.config.rope_parameters["original_max_position_embeddings"]
        self.short, self.scale = ROPE_INIT_FUNCTIONS["longrope"](rope.config)
        self.long, _ = ROPE_INIT_FUNCTIONS["longrope"](rope.config, seq_len=self.original + 1)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.where((position_ids < self.original)[..., None], self.short, self.long)  # [B, S, dim/2]
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(x.dtype), (emb.sin() * self.scale).to(x.dtype)


@pytest.fixture(scope="session")
def longrope_reference() -> Callable[[TinyCheckpoint], Any]:
    """``longrope_reference(checkpoint)``: a copy of its transformers Phi3 model whose rotary picks LongRoPE's
    factors per position (made once per checkpoint)."""
    made: dict[Path, Any] = {}

    def get(checkpoint: TinyCheckpoint) -> Any:
        if checkpoint.path not in made:
            made[checkpoint.path] = copy.deepcopy(checkpoint.model)
            made[checkpoint.path].model.rotary_emb = PerPositionLongRope(checkpoint.model.model.rotary_emb)
        return made[checkpoint.path]

    return get
