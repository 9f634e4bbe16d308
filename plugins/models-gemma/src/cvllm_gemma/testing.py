"""Tiny Gemma checkpoints for tests: the tiny architectures registered with cvllm.testing, the hub's spellings of
their configs, and Gemma 3 multimodal checkpoints (which core's make_checkpoint does not build).

transformers is imported inside the functions: it is a test dependency, not a runtime one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cvllm.testing import register_tiny_architecture
from cvllm.testing.checkpoints import (
    TOKENIZER_VOCAB_SIZE,
    randomize_norms_and_biases,
    tiny_config,
    write_tiny_tokenizer,
)

# A window shorter than the tests' prompts (but for the shortest few).
WINDOW = 8
# Soft-caps small enough to bite on these tiny models: scaled attention scores reach several units, final logits
# a few units (INITIALIZER_RANGE 0.2), so tanh(x / cap) is far from linear.
ATTN_SOFT_CAP = 2.0
FINAL_SOFT_CAP = 5.0
TINY = {"head_dim": 16, "tie_word_embeddings": True}
# the vision tower of the multimodal checkpoints, as small as SigLIP goes: 2 x 2 patches, one layer
TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 28, "patch_size": 14}


def register_tiny_gemmas() -> None:
    """Make gemma, gemma2 and gemma3 known to cvllm.testing's tiny_config and make_checkpoint."""
    register_tiny_architecture("gemma", "GemmaConfig", "GemmaForCausalLM", **TINY)
    register_tiny_architecture("gemma2", "Gemma2Config", "Gemma2ForCausalLM", **TINY, num_hidden_layers=3,
                               sliding_window=WINDOW, attn_logit_softcapping=ATTN_SOFT_CAP,
                               final_logit_softcapping=FINAL_SOFT_CAP)
    register_tiny_architecture("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", **TINY, num_hidden_layers=3,
                               sliding_window=WINDOW, sliding_window_pattern=2)


def hub_rope_spelling(text: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's per-layer-type rope_parameters as hub configs spell them: rope_theta, rope_local_base_freq and
    the global layers' rope_scaling (None when plain)."""
    text = dict(text)
    rope = text.pop("rope_parameters")
    full, sliding = dict(rope["full_attention"]), rope["sliding_attention"]
    text["rope_theta"], text["rope_local_base_freq"] = full.pop("rope_theta"), sliding["rope_theta"]
    text["rope_scaling"] = None if full == {"rope_type": "default"} else full
    return text


def hub_text_config(text: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's text_config as transformers 4 wrote it into the hub's files: the rope in hub
    spelling, no layer_types (the pattern decides), sliding_window_pattern, and only the keys that differ from
    Gemma3TextConfig's defaults."""
    from transformers import Gemma3TextConfig

    text = hub_rope_spelling(text)
    text.pop("layer_types", None)
    text["sliding_window_pattern"] = text.pop("_sliding_window_pattern")
    defaults = hub_rope_spelling(Gemma3TextConfig().to_dict())
    defaults["sliding_window_pattern"] = 6
    return {k: v for k, v in text.items() if k not in defaults or defaults[k] != v or k == "model_type"}


def gemma3_published(path: Path) -> None:
    """Rewrite a Gemma3ForCausalLM's config.json (transformers 5 spelling) as the hub's: full, hub-spelled."""
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    raw = hub_rope_spelling(raw)
    raw.pop("layer_types")
    raw["sliding_window_pattern"] = raw.pop("_sliding_window_pattern")
    raw["torch_dtype"] = raw.pop("dtype")
    config_path.write_text(json.dumps(raw, indent=2))


def legacy_gelu(path: Path) -> None:
    """hidden_act "gelu", as gemma-2b's and gemma-7b's config.json say it (meaning the tanh approximation)."""
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    assert raw["hidden_act"] == "gelu_pytorch_tanh"
    config_path.write_text(json.dumps({**raw, "hidden_act": "gelu"}, indent=2))


def make_multimodal_checkpoint(path: Path, *, seed: int = 0, layout: str = "saved", spelling: str = "published",
                                   **text_overrides: Any):
    """A tiny Gemma3ForConditionalGeneration. ``layout``: "saved" as save_pretrained writes the tensors
    (language_model.model.*, as on the hub) or "v5" as transformers 5 holds them (model.language_model.*);
    ``spelling``: "published" nests the sparse hub text_config, "v5" the full one transformers 5 writes."""
    import transformers

    text = tiny_config("gemma3", **text_overrides)
    config = transformers.Gemma3Config(text_config=text, vision_config=TINY_VISION, mm_tokens_per_image=4,
                                           attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    randomize_norms_and_biases(model, seed)
    model.save_pretrained(path, save_original_format=layout == "saved")
    if spelling == "published":
        config_path = path / "config.json"
        raw = json.loads(config_path.read_text())
        raw["text_config"] = hub_text_config(raw["text_config"])
        raw["torch_dtype"] = raw.pop("dtype")
        raw["eos_token_id"] = raw["text_config"].pop("eos_token_id", text.eos_token_id)  # top level on the hub
        config_path.write_text(json.dumps(raw, indent=2))
    write_tiny_tokenizer(path, vocab_size=TOKENIZER_VOCAB_SIZE)
    return model
