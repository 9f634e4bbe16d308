"""GLM-4 (glm-4-9b as transformers' modeling_glm holds it), built from cvllm's parallel layers.

A Llama-shaped pre-norm decoder with three GLM traits: the rotary turns only the first ``partial_rotary_factor``
(0.5 unless the config says) of each head's features, as GPT-J-style pairs (2i, 2i + 1); q/k/v carry biases
(``attention_bias``, true unless the config says), o_proj none; the MLP's gate and up projections are stored as
one ``gate_up_proj`` tensor, gate rows first. GLM-4-0414 (glm4.py) reuses all of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import (
    Attention,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SiluAndMul,
    get_rope,
)
from cvllm.layers.decoder import DecoderOnlyForCausalLM, PreNormDecoderLayer
from cvllm.weight_loading import WeightTransform, split_rows

# transformers' GlmConfig / Glm4Config default, for configs that name no partial_rotary_factor
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def glm_rope_parameters(config: ModelConfig) -> dict[str, Any]:
    return {"partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR, **config.rope_parameters}


class GlmAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads, config.num_key_value_heads,
                                          bias=bool(config.get("attention_bias", True)))
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, bias=False)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, glm_rope_parameters(config),
                                   interleaved=True)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # rotated by Attention: with GPT-J pairs in the backend's fused rotate-and-write-KV kernel where it has one
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class GlmMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{config.hidden_act}' for GLM (expected silu)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GlmForCausalLM(DecoderOnlyForCausalLM):
    # The checkpoint's tensors that pack into one layer: q/k/v only. gate_up_proj is one tensor there (GGUF's ffn_up
    # too), so a quantizer looks its weights up under that name.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    # what loading places, once weight_transforms has cut gate_up_proj in two
    loading_mapping = {**packed_modules_mapping, "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return PreNormDecoderLayer(config, GlmAttention(config), GlmMLP(config))

    def weight_transforms(self) -> dict[str, WeightTransform]:
        """The checkpoint's fused ``mlp.gate_up_proj`` (float rows, or a GGUF file's rows of blocks) as its gate
        and up halves, which MergedColumnParallelLinear loads as shards 0 and 1: under tensor parallelism each rank
        then takes its rows of both halves."""
        inter = self.config.intermediate_size
        return dict([split_rows(".mlp.gate_up_proj.", [(".mlp.gate_proj.", inter), (".mlp.up_proj.", inter)],
                                (".weight", ".qweight"))])
