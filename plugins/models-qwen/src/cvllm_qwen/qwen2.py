"""Qwen2, as in Hugging Face's modeling_qwen2, built from cvllm's parallel layers.

Covers Qwen2, Qwen2.5, QwQ-32B and DeepSeek-R1-Distill-Qwen: q/k/v biases and no o_proj bias, tied
embeddings, any rope scaling the core supports, and sliding-window attention where transformers applies it
(``use_sliding_window``, and then only on layers from ``max_window_layers`` on). The decoder layer, model and
causal-LM classes here are the skeleton the Qwen3 and MoE variants reuse, each choosing its own attention and
MLP per layer.
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

# transformers' Qwen2Config default, for configs that do not say
DEFAULT_MAX_WINDOW_LAYERS = 28


def sliding_window_layers(config: ModelConfig) -> list[int | None]:
    """Each layer's window, as transformers 5.24's Qwen2/Qwen3 configs decide it: ``layer_types`` when the
    config lists them (transformers 5 writes them), else sliding on layers >= ``max_window_layers``. Either
    way only with ``use_sliding_window`` (without it transformers sets ``sliding_window`` to None)."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    types = config.get("layer_types")
    if types is None:
        first = config.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(config.num_hidden_layers)]
    return [window if kind == "sliding_attention" else None for kind in types[: config.num_hidden_layers]]


class Qwen2Attention(nn.Module):
    def __init__(self, config: ModelConfig, sliding_window: int | None, qkv_bias: bool = True,
                 o_bias: bool = False):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads, config.num_key_value_heads,
                                          bias=qkv_bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, bias=o_bias)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, config.rope_parameters)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads,
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class Qwen2MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{config.hidden_act}' for Qwen (expected silu)")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


# the pre-norm decoder skeleton, core's (cvllm.layers.decoder), under the names the Qwen files use
Qwen2DecoderLayer = PreNormDecoderLayer
Qwen2Model = DecoderStack


class Qwen2ForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_key_value_heads % tp_size() and tp_size() % config.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide or be divisible by the tensor-parallel size")
        self.config = config
        self.sliding_windows = self.layer_windows(config)
        self.model = Qwen2Model(config, self.make_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)
        feed(getattr(self.model, "norm", None), self.lm_head)   # the final norm's output goes to the head

    def layer_windows(self, config: ModelConfig) -> list[int | None]:
        return sliding_window_layers(config)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        attention = Qwen2Attention(config, self.sliding_windows[layer_idx])
        return Qwen2DecoderLayer(config, attention, Qwen2MLP(config, config.intermediate_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors minus a tied LM head's copy (the embedding is the head)."""
        tied = self.config.get("tie_word_embeddings", False)
        return ((n, t) for n, t in weights if not (tied and n == "lm_head.weight"))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_name(self, self.checkpoint_weights(weights), self.packed_modules_mapping)
