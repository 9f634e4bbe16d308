"""Qwen3-MoE, as in Hugging Face's modeling_qwen3_moe: Qwen3's attention (per-head q/k norms) with routed
experts and no shared expert; ``norm_topk_prob``, ``decoder_sparse_step`` and ``mlp_only_layers`` as in
Qwen2-MoE."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import ReplicatedLinear, load_weights_with_experts
from cvllm_qwen.qwen2 import Qwen2DecoderLayer, Qwen2MLP
from cvllm_qwen.qwen2_moe import is_moe_layer, num_experts, routed_experts
from cvllm_qwen.qwen3 import Qwen3Attention, Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config))  # the router
        self.experts = routed_experts(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def layer_windows(self, config: ModelConfig) -> list[int | None]:
        # transformers' Qwen3-MoE has no per-layer types: with use_sliding_window every layer slides
        window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
        return [window] * config.num_hidden_layers

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = Qwen3Attention(config, self.sliding_windows[layer_idx])
        mlp = Qwen3MoeSparseMoeBlock(config) if is_moe_layer(config, layer_idx) else Qwen2MLP(
            config, config.intermediate_size)
        return Qwen2DecoderLayer(config, attention, mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_with_experts(self, self.checkpoint_weights(weights), self.packed_modules_mapping)
