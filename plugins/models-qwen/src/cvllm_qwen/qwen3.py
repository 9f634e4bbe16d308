"""Qwen3, as in Hugging Face's modeling_qwen3: Qwen2's layout with an RMSNorm over each head of q and k
before rotary, ``head_dim`` from the config, and one ``attention_bias`` flag for q/k/v and o_proj."""

from __future__ import annotations

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import RMSNorm
from cvllm_qwen.qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2MLP


class Qwen3Attention(Qwen2Attention):
    def __init__(self, config: ModelConfig, sliding_window: int | None):
        bias = bool(config.get("attention_bias", False))
        super().__init__(config, sliding_window, qkv_bias=bias, o_bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # each head of q and k normalised before rotary: in the rotary kernel where the backend has one
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb, qk_norm=(self.q_norm, self.k_norm)))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = Qwen3Attention(config, self.sliding_windows[layer_idx])
        return Qwen2DecoderLayer(config, attention, Qwen2MLP(config, config.intermediate_size))
