"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B), as in Hugging Face's modeling_qwen2_moe.

Each MoE layer routes every token to ``num_experts_per_tok`` of ``num_experts`` experts (softmax, top-k,
renormalised only with ``norm_topk_prob``) and adds a shared expert scaled by
``sigmoid(shared_expert_gate(x))``. ``decoder_sparse_step`` and ``mlp_only_layers`` decide which layers are
MoE; the others have a dense MLP of ``intermediate_size``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import FusedMoE, ReplicatedLinear, load_weights_with_experts
from cvllm_qwen.qwen2 import DEFAULT_MAX_WINDOW_LAYERS, Qwen2Attention, Qwen2DecoderLayer, Qwen2ForCausalLM, Qwen2MLP


def num_experts(config: ModelConfig) -> int:
    """Published configs say ``num_experts``; transformers 5 writes Qwen3-MoE's as ``num_local_experts``."""
    value = config.get("num_experts")
    return int(value if value is not None else config.get("num_local_experts", 0))


def is_moe_layer(config: ModelConfig, layer_idx: int) -> bool:
    return (layer_idx not in (config.get("mlp_only_layers") or []) and num_experts(config) > 0
            and (layer_idx + 1) % config.get("decoder_sparse_step", 1) == 0)


def routed_experts(config: ModelConfig) -> FusedMoE:
    return FusedMoE(num_experts(config), config.num_experts_per_tok, config.hidden_size,
                    config.moe_intermediate_size, renormalize=bool(config.get("norm_topk_prob", False)))


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config))  # the router
        self.experts = routed_experts(config)
        self.shared_expert = Qwen2MLP(config, config.shared_expert_intermediate_size)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        routed = self.experts(hidden, self.gate(hidden))
        shared = torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return routed + shared


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    def layer_windows(self, config: ModelConfig) -> list[int | None]:
        """transformers' Qwen2MoeConfig rule (not Qwen2's): with ``use_sliding_window``, the layers with an even
        index below ``max_window_layers`` slide; ``layer_types``, when the config lists them, decide instead."""
        window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
        types = config.get("layer_types")
        if types is None:
            below = config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
            types = ["sliding_attention" if i % 2 == 0 and i < below else "full_attention"
                     for i in range(config.num_hidden_layers)]
        return [window if kind == "sliding_attention" else None for kind in types[: config.num_hidden_layers]]

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = Qwen2Attention(config, self.sliding_windows[layer_idx], qkv_bias=bool(config.get("qkv_bias", True)))
        mlp = Qwen2MoeSparseMoeBlock(config) if is_moe_layer(config, layer_idx) else Qwen2MLP(
            config, config.intermediate_size)
        return Qwen2DecoderLayer(config, attention, mlp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_with_experts(self, self.checkpoint_weights(weights), self.packed_modules_mapping)
