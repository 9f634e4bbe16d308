"""Phi-3, Phi-3.5 and Phi-4-mini, as in Hugging Face's modeling_phi3, built from cvllm's parallel layers.

Llama's pre-norm layer (RMSNorm, SiLU-gated MLP, no biases) with the checkpoints' fused ``qkv_proj`` and
``gate_up_proj`` tensors, which loading splits into the q/k/v and gate/up shards the parallel layers take (so
tensor parallelism shards them as it does Llama's). Partial rotary (``partial_rotary_factor``: Phi-4-mini),
sliding-window attention on every layer when the config has a ``sliding_window`` (as transformers applies it),
tied embeddings (Phi-4-mini), and LongRoPE.

LongRoPE (rope type ``longrope``; ``su`` and, as transformers' Phi3Config reads them, ``yarn`` are older names)
rotates positions below ``original_max_position_embeddings`` with ``short_factor`` and positions from there on
with ``long_factor``, cos/sin scaled by transformers' attention factor (core's ``rotary.py``). Where this differs
from transformers: transformers picks one set of factors for a whole sequence, the long one for every position
as soon as the sequence is longer than the original context (its forward pass switches on the pass's last
position, and its ``generate`` drops the cache and recomputes the whole sequence with the long factors when a
generation grows past the switch). Hence:

- a sequence (prompt plus generation) of at most ``original_max_position_embeddings`` tokens gives transformers'
  logits and greedy tokens;
- a longer one does not: positions below the switch keep their short angles here (in the cache too), where
  transformers rotates them with the long factors. Positions from the switch on have the same angles in both,
  but they attend to keys rotated differently. This is vLLM's choice: a position's angles never depend on the
  rest of the sequence, which keeps chunked prefill, prefix caching and preemption exact and needs no recompute
  at the switch.
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

# Phi3Config's default, for a longrope config that names no original context
DEFAULT_ORIGINAL_MAX_POSITION = 4096


def phi3_rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """The config's rope parameters as transformers' Phi3 reads them: "yarn" is an older name of longrope there
    (core's normalise_rope already took "su" and the top-level ``original_max_position_embeddings``)."""
    params = dict(config.rope_parameters)
    if params["rope_type"] == "yarn":
        params["rope_type"] = "longrope"
        if config.get("original_max_position_embeddings") is not None:
            params["original_max_position_embeddings"] = config.original_max_position_embeddings
    if params["rope_type"] == "longrope":
        params.setdefault("original_max_position_embeddings", DEFAULT_ORIGINAL_MAX_POSITION)
    return params


class Phi3Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads, config.num_key_value_heads)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, phi3_rope_parameters(config))
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads,
                              sliding_window=config.get("sliding_window"))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class Phi3MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{config.hidden_act}' for Phi-3 (expected silu)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Phi3ForCausalLM(DecoderOnlyForCausalLM):
    # the checkpoint stores qkv_proj and gate_up_proj fused, as the layers are: a quantizer finds their tensors
    # under those names (a GGUF file's attn_qkv and ffn_up stay in their blocks)
    packed_modules_mapping = {}
    # the shards weight_transforms cuts the fused tensors into, and where each one goes
    loading_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return PreNormDecoderLayer(config, Phi3Attention(config), Phi3MLP(config))

    def weight_transforms(self) -> dict[str, WeightTransform]:
        """The fused ``qkv_proj`` / ``gate_up_proj`` tensors (float weights, or a GGUF file's rows of blocks) cut into
        q/k/v and gate/up row blocks under the names the packed mapping knows; a tensor-parallel rank then takes
        its rows of each."""
        c = self.config
        q, kv, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size
        rows = (".weight", ".qweight")
        return dict([split_rows(".qkv_proj.", [(".q_proj.", q), (".k_proj.", kv), (".v_proj.", kv)], rows),
                     split_rows(".gate_up_proj.", [(".gate_proj.", inter), (".up_proj.", inter)], rows)])
