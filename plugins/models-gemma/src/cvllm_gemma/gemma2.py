"""Gemma 2, as in Hugging Face's modeling_gemma2: Gemma's pieces in a sandwich layout (four norms a layer: before
and after attention, before and after the MLP), local sliding-window layers alternating with global ones,
``query_pre_attn_scalar ** -0.5`` as the softmax scale, and tanh soft-capping of the attention scores
(``attn_logit_softcapping``) and of the final logits (``final_logit_softcapping``)."""

from __future__ import annotations

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm_gemma.gemma import GemmaForCausalLM
from cvllm_gemma.layers import GemmaAttention, GemmaMLP, GemmaRMSNorm

# transformers' Gemma2Config defaults, for configs that do not say
DEFAULT_QUERY_PRE_ATTN_SCALAR = 256
DEFAULT_ATTN_SOFT_CAP = 50.0
DEFAULT_FINAL_SOFT_CAP = 30.0
DEFAULT_SLIDING_WINDOW = 4096
SLIDING, FULL = "sliding_attention", "full_attention"


def layer_types(config: ModelConfig, pattern: int) -> list[str]:
    """``layer_types`` when the config lists them (transformers 5 writes them), else the published configs' rule
    as transformers applies it: every ``pattern``-th layer global, the others sliding (Gemma 2: 2, so layer 0 is
    sliding; Gemma 3: ``sliding_window_pattern``, 6)."""
    types = config.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(config.num_hidden_layers)]
    types = list(types[: config.num_hidden_layers])
    unknown = set(types) - {SLIDING, FULL}
    if unknown:
        raise ValueError(f"unsupported layer_types {sorted(unknown)} for Gemma (expected {SLIDING}, {FULL})")
    return types


class Gemma2DecoderLayer(nn.Module):
    """Sandwich norms, the residual carried beside the hidden state (added inside the next pre-norm):
    ``h, r = input_layernorm(h + r); h = post_attention_layernorm(self_attn(h));
    h, r = pre_feedforward_layernorm(h + r); h = post_feedforward_layernorm(mlp(h))``."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(GemmaForCausalLM):
    SLIDING_PATTERN = 2

    def final_soft_cap(self, config: ModelConfig) -> float | None:
        return config.get("final_logit_softcapping", DEFAULT_FINAL_SOFT_CAP)

    def attention_soft_cap(self, config: ModelConfig) -> float | None:
        return config.get("attn_logit_softcapping", DEFAULT_ATTN_SOFT_CAP)

    def sliding_pattern(self, config: ModelConfig) -> int:
        return self.SLIDING_PATTERN

    def prepare(self, config: ModelConfig) -> None:
        if config.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention (Gemma as an encoder) is not supported: cvllm decodes")
        self.layer_types = layer_types(config, self.sliding_pattern(config))
        self.sliding_window = config.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        self.attn_scale = config.get("query_pre_attn_scalar", DEFAULT_QUERY_PRE_ATTN_SCALAR) ** -0.5

    def window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING else None

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = GemmaAttention(config, self.attn_scale, config.rope_parameters,
                                   sliding_window=self.window(layer_idx), soft_cap=self.attention_soft_cap(config))
        mlp = GemmaMLP(config, config.get("hidden_activation") or "gelu_pytorch_tanh")
        return Gemma2DecoderLayer(config, attention, mlp)
