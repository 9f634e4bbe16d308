"""Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) served as text: where they keep the
language model, for core's reader (``cvllm.checkpoint.NestedTextModel``), which picks its config (``text_config``)
and weights out and leaves the vision tower and projector unread.

A hub config.json nests the text model's settings under ``text_config`` and, written by transformers 4, keeps
there only what differs from ``Gemma3TextConfig``'s defaults (gemma-3-4b-it lists hidden_size, layers,
rope_scaling, sliding_window ... but not its heads, head_dim or vocabulary): the defaults fill in the rest.
The weights come as transformers writes them (``language_model.model.*``) or as transformers 5 holds them in
memory (``model.language_model.*``).
"""

from __future__ import annotations

from typing import Any

from cvllm.checkpoint import NestedTextModel

# transformers 5.24's Gemma3TextConfig defaults (and the rope bases its rope conversion falls back to)
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "pad_token_id": 0, "eos_token_id": 1,
    "bos_token_id": 2, "tie_word_embeddings": True, "attention_bias": False, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "final_logit_softcapping": None, "attn_logit_softcapping": None,
    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6,
}

GEMMA3_TEXT = NestedTextModel(
    config_key="text_config",
    defaults=GEMMA3_TEXT_DEFAULTS,
    weight_prefixes={
        "language_model.model.": "model.",      # as saved (the hub's files; transformers 5 still writes these)
        "language_model.lm_head.": "lm_head.",
        "model.language_model.": "model.",      # transformers 5's module layout (save_original_format=False)
    },
    skip_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
)
