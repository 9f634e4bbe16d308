"""Model configuration: a Hugging Face config.json, normalised to one spelling.

Published checkpoints say ``rope_theta``/``rope_scaling``/``torch_dtype``; transformers 5 writes
``rope_parameters``/``dtype``. Models read only the normalised fields set here:
``rope_parameters`` (always a dict with ``rope_type`` and ``rope_theta``), ``head_dim`` and ``dtype``.

A model class may name its family's own spellings of those keys in ``config_aliases`` (GPT-NeoX's
``{"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}``): a checkpoint's alias fills the
field it stands for before normalising, where the config does not set that field itself. The file as read stays
reachable as ``config.raw_config``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


class ConfigError(ValueError):
    """A config file is missing or does not say what a model needs."""


class ModelConfig(SimpleNamespace):
    """Attribute access over config.json, with the normalised fields filled in.

    Missing attributes read as ``None`` only through ``get``; plain attribute access raises, so a
    model that needs a key fails loudly rather than silently using None.
    """

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def to_dict(self) -> dict[str, Any]:
        """The normalised fields (without ``raw_config``, the file as read)."""
        return {key: value for key, value in vars(self).items() if key != "raw_config"}


def normalise_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """Both rope spellings → ``{"rope_type": ..., "rope_theta": ..., <scaling keys>}``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        # transformers 5 may nest per-layer-type parameters ({"full_attention": {...}}); take the plain form
        if "rope_type" not in params and "rope_theta" not in params and len(params) == 1:
            params = next(iter(params.values()))
        rope = dict(params)
    else:
        rope = dict(raw.get("rope_scaling") or {})
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    if rope["rope_type"] == "su":  # legacy name of longrope
        rope["rope_type"] = "longrope"
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = raw.get("rope_theta", 10000.0)
    if "partial_rotary_factor" not in rope and raw.get("partial_rotary_factor") is not None:
        rope["partial_rotary_factor"] = raw["partial_rotary_factor"]
    # Phi-3's configs keep the original context top-level, where transformers' longrope reads it first
    if rope["rope_type"] == "longrope" and raw.get("original_max_position_embeddings") is not None:
        rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return rope


def model_config_from_dict(raw: dict[str, Any], source: str = "config.json",
                           aliases: Mapping[str, str] | None = None) -> ModelConfig:
    """``aliases``: {the checkpoint's key: the field it fills} (a model class's ``config_aliases``)."""
    as_read = raw
    raw = dict(raw)
    for alias, field in (aliases or {}).items():
        if alias in raw and raw.get(field) is None:
            raw[field] = raw[alias]
    if not raw.get("architectures"):
        raise ConfigError(f"{source}: no 'architectures' list; cannot tell which model class to build")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if key not in raw and "text_config" not in raw:
            raise ConfigError(f"{source}: missing required key '{key}'")
    raw["rope_parameters"] = normalise_rope(raw)
    raw["rope_theta"] = raw["rope_parameters"]["rope_theta"]
    if raw.get("num_key_value_heads") is None:  # absent or null: multi-head attention, as transformers reads it
        raw["num_key_value_heads"] = raw.get("num_attention_heads")
    if raw.get("head_dim") is None and "hidden_size" in raw:
        raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    raw["dtype"] = str(dtype).removeprefix("torch.")
    raw.pop("torch_dtype", None)
    raw["raw_config"] = dict(as_read)
    return ModelConfig(**raw)


def load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def resolve_dtype(requested: str | torch.dtype | None, config: ModelConfig) -> torch.dtype:
    """``auto`` (or None) means the checkpoint's own dtype; anything else is parsed by name."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested is None or requested == "auto":
        return DTYPES.get(str(config.get("dtype", "float32")), torch.float32)
    try:
        return DTYPES[requested.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype '{requested}'; use auto, float32, float16 or bfloat16") from None
