"""Gemma 3 (text), as in Hugging Face's modeling_gemma3: Gemma 2's sandwich layout plus a (1 + w) RMSNorm over each
head of q and k before rotary, and two rotary embeddings: the local base (``rope_local_base_freq``, no scaling) on
the sliding-window layers, ``rope_theta`` with ``rope_scaling`` on the global ones. One global layer in
``sliding_window_pattern`` (6) unless the config lists ``layer_types``.

As transformers 5.24 computes it: no attention soft-capping (Gemma3Attention never passes
``attn_logit_softcapping`` on; every published config has it null), and the final soft-cap only in
Gemma3ForCausalLM, not in Gemma3ForConditionalGeneration (null in every published config too).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from cvllm.config import ModelConfig
from cvllm_gemma.gemma2 import FULL, SLIDING, Gemma2DecoderLayer, Gemma2ForCausalLM
from cvllm_gemma.layers import GemmaAttention, GemmaMLP
from cvllm_gemma.multimodal import GEMMA3_TEXT, GEMMA3_TEXT_DEFAULTS


def rope_by_layer_type(config: ModelConfig) -> dict[str, dict[str, Any]]:
    """The rotary parameters of the global (``full_attention``) and the local (``sliding_attention``) layers."""
    params = config.rope_parameters
    global_theta = GEMMA3_TEXT_DEFAULTS["rope_theta"]
    local_theta = config.get("rope_local_base_freq", GEMMA3_TEXT_DEFAULTS["rope_local_base_freq"])
    if FULL in params or SLIDING in params:  # transformers 5 writes one entry per layer type
        def entry(layer_type: str, theta: float) -> dict[str, Any]:
            given = dict(params.get(layer_type) or {})
            if "type" in given:
                given.setdefault("rope_type", given.pop("type"))
            return {"rope_type": "default", "rope_theta": theta, **given}

        return {FULL: entry(FULL, global_theta), SLIDING: entry(SLIDING, local_theta)}
    # the published spelling: core has already read rope_theta and rope_scaling into rope_parameters
    return {FULL: dict(params), SLIDING: {"rope_type": "default", "rope_theta": local_theta}}


def sliding_window_pattern(config: ModelConfig) -> int:
    """One layer in this many is global: hub configs say ``sliding_window_pattern``, transformers 5 writes it as
    ``_sliding_window_pattern`` (beside the ``layer_types`` it decided)."""
    return int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
               or GEMMA3_TEXT_DEFAULTS["sliding_window_pattern"])


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def final_soft_cap(self, config: ModelConfig) -> float | None:
        return config.get("final_logit_softcapping")

    def attention_soft_cap(self, config: ModelConfig) -> float | None:
        return None   # transformers 5.24's Gemma3Attention never passes attn_logit_softcapping on

    def sliding_pattern(self, config: ModelConfig) -> int:
        return sliding_window_pattern(config)

    def prepare(self, config: ModelConfig) -> None:
        super().prepare(config)
        self.rope = rope_by_layer_type(config)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        layer_type = self.layer_types[layer_idx]
        attention = GemmaAttention(config, self.attn_scale, self.rope[layer_type], qk_norm=True,
                                   sliding_window=self.window(layer_idx), soft_cap=self.attention_soft_cap(config))
        mlp = GemmaMLP(config, config.get("hidden_activation") or "gelu_pytorch_tanh")
        return Gemma2DecoderLayer(config, attention, mlp)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Only the language model of a multimodal checkpoint: text in, text out. Core's checkpoint reader flattens
    the config and renames the tensors as ``nested_text_model`` says (multimodal.py)."""

    nested_text_model = GEMMA3_TEXT

    def text_config(self, config: ModelConfig) -> ModelConfig:
        return GEMMA3_TEXT.text_config(config)  # a config built straight from a nested config.json

    def final_soft_cap(self, config: ModelConfig) -> float | None:
        return None
