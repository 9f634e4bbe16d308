"""Multimodal checkpoints served by a text-only model class: the language model's config nested under one key of
config.json (``text_config``) and its tensors under a prefix (``language_model.model.``), next to towers (vision,
audio, projector) the class does not build.

A model class says so with a class attribute, ``nested_text_model = NestedTextModel(...)``; the Hugging Face
directory reader (hf_dir.py) then opens such a checkpoint as if it held the text model alone: the config flattened
(what the engine reads at the top level, ``vocab_size``, ``max_position_embeddings``, ``eos_token_id``, is the text
model's) and the tensors renamed, the other towers' never read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cvllm.config import ModelConfig, model_config_from_dict

Weights = Callable[[], Iterator[tuple[str, Any]]]


@dataclass(frozen=True)
class NestedTextModel:
    """Where a multimodal checkpoint keeps the language model.

    ``config_key``: the key of the nested config. ``defaults``: the nested config class's defaults, under the outer
    config's keys and the nested ones (transformers 4 wrote only a nested config's differences from its class's
    defaults into the hub's files). ``outer_only``: outer keys the text model does not inherit (the other towers'
    configs). ``weight_prefixes``: {checkpoint prefix: the model's prefix}, the first match renaming a tensor;
    ``skip_prefixes``: tensors of the other towers, dropped unread. A tensor matching neither keeps its name.
    """

    config_key: str = "text_config"
    weight_prefixes: Mapping[str, str] = field(default_factory=dict)
    skip_prefixes: tuple[str, ...] = ()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    outer_only: tuple[str, ...] = ("vision_config", "audio_config")

    def holds(self, raw: Mapping[str, Any]) -> bool:
        """Whether a config.json (as read) nests the text model's config."""
        return isinstance(raw.get(self.config_key), Mapping)

    def flat_config(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """A config.json (as read) flattened: the defaults, under the outer keys, under the nested ones; the outer
        ``architectures`` kept (the class registered for it serves the checkpoint, whatever the nested one says)."""
        outer = {k: v for k, v in raw.items() if k != self.config_key and k not in self.outer_only}
        flat = {**self.defaults, **outer, **raw[self.config_key]}
        if raw.get("architectures"):
            flat["architectures"] = raw["architectures"]
        return flat

    def text_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` built from a nested config.json, flattened; a flat one unchanged."""
        raw = config.get("raw_config") or {}
        if not self.holds(raw) or config.get(self.config_key) is None:
            return config
        flat = model_config_from_dict(self.flat_config(raw), source=f"config.json {self.config_key}")
        flat.raw_config = dict(raw)
        return flat

    def weight_name(self, name: str) -> str | None:
        """The model's name for a checkpoint tensor; None for another tower's."""
        if name.startswith(self.skip_prefixes):
            return None
        for prefix, ours in self.weight_prefixes.items():
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return name

    def weights(self, weights: Weights) -> Weights:
        """The checkpoint's weight iterator renamed, the other towers' tensors left out (and unread: a lazy tensor
        stays a lazy tensor)."""
        def renamed() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights():
                ours = self.weight_name(name)
                if ours is not None:
                    yield ours, tensor

        return renamed
