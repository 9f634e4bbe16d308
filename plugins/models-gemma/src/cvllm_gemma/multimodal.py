"""Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) served as text: the language model's
config (``text_config``) and weights picked out of them, the vision tower and projector left unread.

A hub config.json nests the text model's settings under ``text_config`` and, written by transformers 4, keeps
there only what differs from ``Gemma3TextConfig``'s defaults (gemma-3-4b-it lists hidden_size, layers,
rope_scaling, sliding_window ... but not its heads, head_dim or vocabulary): the defaults fill in the rest.
The weights come as transformers writes them (``language_model.model.*``) or as transformers 5 holds them in
memory (``model.language_model.*``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cvllm.config import ModelConfig, load_json, model_config_from_dict

ARCHITECTURE = "Gemma3ForConditionalGeneration"

# transformers 5.24's Gemma3TextConfig defaults (and the rope bases its rope conversion falls back to)
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
}
# what core derives for a top-level config (none of it meant for the text model), and the towers' own configs
_TOP_LEVEL_ONLY = ("text_config", "vision_config", "rope_parameters", "rope_theta", "num_key_value_heads", "head_dim")

# checkpoint prefix -> this model's; the text model's tensors in either layout
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),      # as saved (the hub's files; transformers 5 still writes these)
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),      # transformers 5's module layout (save_original_format=False)
)
_OTHER_TOWERS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_model_config(config: ModelConfig) -> ModelConfig:
    """A multimodal config flattened to its text model's (the top level's ``architectures``, dtype, eos ... kept
    where ``text_config`` does not say); a config without ``text_config`` unchanged."""
    nested = config.get("text_config")
    if nested is None:
        return config
    top = {key: value for key, value in config.to_dict().items() if key not in _TOP_LEVEL_ONLY}
    return model_config_from_dict({**GEMMA3_TEXT_DEFAULTS, **top, **nested}, source="config.json text_config")


def text_weight_name(name: str) -> str | None:
    """The text model's name for a checkpoint tensor, or None for the vision tower's and the projector's."""
    if name.startswith(_OTHER_TOWERS):
        return None
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return ours + name[len(prefix):]
    return name


def open_text_checkpoint(path: str):
    """The Hugging Face directory at ``path`` with its config flattened to the text model's, when it holds a
    ``Gemma3ForConditionalGeneration``; else None. Flattening here, as the checkpoint opens, is what lets the
    engine read ``vocab_size``, ``max_position_embeddings`` and the eos ids, which it takes from the top level."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    raw = load_json(config_file, "config.json")
    if (raw.get("architectures") or [None])[0] != ARCHITECTURE or not isinstance(raw.get("text_config"), dict):
        return None
    from cvllm.checkpoint.hf_dir import open_hf_checkpoint

    checkpoint = open_hf_checkpoint(path)
    checkpoint.config = text_model_config(checkpoint.config)
    return checkpoint
