"""GLM-4-0414 (transformers' modeling_glm4): GLM-4's attention and MLP in a "sandwich" layer that also normalises
each sublayer's output before it joins the residual stream:

    x = x + post_self_attn_layernorm(self_attn(input_layernorm(x)))
    x = x + post_mlp_layernorm(mlp(post_attention_layernorm(x)))

The residual is carried beside the hidden state, as in core's PreNormDecoderLayer, so the pre-norms stay the
backend's fused add + RMSNorm; the post-norms are plain RMSNorms.
"""

from __future__ import annotations

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import RMSNorm
from cvllm.layers.decoder import PreNormDecoderLayer
from cvllm_glm.glm import GlmAttention, GlmForCausalLM, GlmMLP


class Glm4DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__(config, self_attn, mlp)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual


class Glm4ForCausalLM(GlmForCausalLM):
    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Glm4DecoderLayer(config, GlmAttention(config), GlmMLP(config))
