"""DeepSeek-V2 (Lite, Chat) and DeepSeek-V3 / R1, as in transformers 5.24's modeling_deepseek_v2 / _v3.

A decoder of multi-head latent attention (mla.py) and, from layer ``first_k_dense_replace`` on, a mixture of
experts: ``n_routed_experts`` routed (routing.py: V2's softmax greedy or group-limited greedy, V3's sigmoid
``noaux_tc`` with its correction bias), times ``routed_scaling_factor``, plus ``n_shared_experts`` always-on
experts as one MLP. The first layers have a dense MLP of ``intermediate_size``. V2 rotates the rope dimensions
as interleaved pairs; V3 too unless ``rope_interleave`` is false.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.lazy import materialize
from cvllm.config import ModelConfig
from cvllm.layers import (
    FusedMoE,
    MergedColumnParallelLinear,
    RowParallelLinear,
    SiluAndMul,
    load_weights_with_experts,
)
from cvllm.layers.decoder import DecoderOnlyForCausalLM, PreNormDecoderLayer
from cvllm_deepseek.mla import DeepseekV2Attention
from cvllm_deepseek.routing import deepseek_routing


class DeepseekV2MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int, reduce_results: bool = True):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{config.hidden_act}' for DeepSeek (expected silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DeepseekRouter(nn.Module):
    """The router's weight [E, H] (and V3's correction bias [E]): plain parameters, not a linear layer, so that no
    quantization touches them (transformers computes the logits in float32; llama.cpp keeps ffn_gate_inp F32)."""

    def __init__(self, hidden_size: int, experts: int, corrected: bool):
        super().__init__()
        # float32 as transformers keeps it: the logits need no per-step cast of the weight
        self.weight = nn.Parameter(torch.empty(experts, hidden_size, dtype=torch.float32), requires_grad=False)
        # float32 whatever the model's dtype, as transformers keeps it: a rounded bias could change the choice
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32),
                                                    requires_grad=False) if corrected else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight)


class DeepseekV2MoE(nn.Module):
    def __init__(self, config: ModelConfig, version: int):
        super().__init__()
        self.routing = deepseek_routing(config, version)
        experts = config.get("n_routed_experts") or config.get("num_local_experts")
        self.gate = DeepseekRouter(config.hidden_size, experts, corrected=version == 3)
        self.experts = FusedMoE(experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size)
        shared = config.get("n_shared_experts") or 0
        self.shared_experts = DeepseekV2MLP(config, config.moe_intermediate_size * shared) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing(self.gate(hidden), self.gate.e_score_correction_bias)
        out = self.experts.forward_routed(hidden, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(hidden)


def make_layer(config: ModelConfig, layer_idx: int, version: int) -> PreNormDecoderLayer:
    """Multi-head latent attention, and a dense MLP below ``first_k_dense_replace``, the MoE from there on."""
    interleaved = version == 2 or bool(config.get("rope_interleave", True))
    dense = layer_idx < (config.get("first_k_dense_replace") or 0)
    mlp = DeepseekV2MLP(config, config.intermediate_size) if dense else DeepseekV2MoE(config, version)
    return PreNormDecoderLayer(config, DeepseekV2Attention(config, interleaved), mlp)


class DeepseekV2ForCausalLM(DecoderOnlyForCausalLM):
    version = 2
    packed_modules_mapping = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def make_layer(self, config: ModelConfig, layer_idx: int) -> PreNormDecoderLayer:
        return make_layer(config, layer_idx, self.version)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # DeepSeek-V3/R1 checkpoints carry a multi-token-prediction layer after the last (num_nextn_predict_layers):
        # speculative decoding's, unused here
        last = self.config.num_hidden_layers
        kept = ((n, t) for n, t in self.untied(weights) if not n.startswith(f"model.layers.{last}."))
        merged: set[str] = set()
        loaded = load_weights_with_experts(self, self._gguf_forms(kept, merged), self.packed_modules_mapping)
        return loaded | merged

    def _gguf_forms(self, weights: Iterable[tuple[str, torch.Tensor]],
                    merged: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """llama.cpp's spellings (gguf_adapter.py): k_b / v_b merged into kv_b_proj as they come (noted in
        ``merged``), the correction bias as ``e_score_correction.bias``; the rest passes through."""
        for name, tensor in weights:
            module, _, part = name.rpartition(".self_attn.")
            if part in ("k_b_proj", "v_b_proj", "k_b_proj.weight", "v_b_proj.weight"):
                attn = self.get_submodule(f"{module}.self_attn")
                attn.load_split_kv_b(part.removesuffix(".weight"), materialize(tensor))
                merged.add(f"{module}.self_attn.kv_b_proj.weight")
            elif name.endswith(".mlp.gate.e_score_correction.bias"):
                yield name.replace("e_score_correction.bias", "e_score_correction_bias"), tensor
            else:
                yield name, tensor


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3
