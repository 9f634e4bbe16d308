"""Llama, as in Hugging Face's modeling_llama, built from cvllm's parallel layers.

Covers Llama 1/2/3/3.1/3.2, Yi and DeepSeek-R1-Distill-Llama: attention/MLP biases, tied
embeddings, any rope scaling the core supports, and head_dim != hidden_size / num_heads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.distributed import tp_size
from cvllm.layers import (
    Attention,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    SiluAndMul,
    get_rope,
)
from cvllm.layers.decoder import DecoderStack, PreNormDecoderLayer, feed
from cvllm.weight_loading import load_weights_by_name


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, total_heads, total_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden, bias=bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, config.rope_parameters)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        bias = bool(config.get("mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{config.hidden_act}' for Llama (expected silu)")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, sliding_window: int | None = None):
        super().__init__(config, LlamaAttention(config, layer_idx, sliding_window), LlamaMLP(config))


class LlamaModel(DecoderStack):
    def __init__(self, config: ModelConfig, sliding_window: int | None = None):
        super().__init__(config, lambda config, i: LlamaDecoderLayer(config, i, sliding_window))


class LlamaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, sliding_window: int | None = None):
        super().__init__()
        if config.num_key_value_heads % tp_size() and tp_size() % config.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide or be divisible by the tensor-parallel size")
        self.config = config
        self.model = LlamaModel(config, sliding_window)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)
        feed(getattr(self.model, "norm", None), self.lm_head)   # the final norm's output goes to the head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.get("tie_word_embeddings", False)
        weights = ((n, t) for n, t in weights if not (tied and n == "lm_head.weight"))
        return load_weights_by_name(self, weights, self.packed_modules_mapping)
