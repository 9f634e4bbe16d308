"""The pieces every Gemma generation shares: the (1 + weight) RMSNorm, the embedding scaled by sqrt(hidden_size),
the GeGLU MLP, tanh soft-capping, and one attention module whose options (scale, window, soft-cap, q/k norms, rope)
tell the generations apart."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import (
    Attention,
    GeluAndMul,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from cvllm.layers.layernorm import GemmaRMSNorm  # (1 + weight), fused on backends that can (re-exported here)

# transformers' activation names -> F.gelu's ``approximate``
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@functools.cache
def rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` as ``dtype`` holds it (sqrt(3072) = 55.43 is 55.5 in bfloat16), back as a Python float."""
    return torch.tensor(value, dtype=dtype, device="cpu").item()


class GemmaScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times sqrt(hidden_size), the factor rounded to the activations' dtype first (transformers
    multiplies by a tensor of that dtype). The product of two bf16/fp16 values is exact in fp32, so multiplying by
    the rounded factor as a Python float gives the same numbers, with no tensor made per step (graph-safe)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids)
        return hidden * rounded_to(self.scale, hidden.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``, in the order transformers computes it (divide, tanh, multiply)."""
    return x if cap is None else torch.tanh(x / cap) * cap


def gelu_approximation(activation: str) -> str:
    if activation not in GELU_APPROXIMATIONS:
        raise ValueError(f"unsupported hidden activation '{activation}' for Gemma "
                         f"(supported: {', '.join(GELU_APPROXIMATIONS)})")
    return GELU_APPROXIMATIONS[activation]


class GemmaMLP(nn.Module):
    """GeGLU: down(gelu(gate(x)) * up(x)), gate and up in one matmul."""

    def __init__(self, config: ModelConfig, activation: str):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act_fn = GeluAndMul(approximate=gelu_approximation(activation))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    """q/k/v (one matmul), rotary, paged attention, o_proj. ``qk_norm``: Gemma 3's (1 + w) RMSNorm over each head
    of q and k before rotary; ``soft_cap``: Gemma 2's ``cap * tanh(scores / cap)`` on the scaled scores."""

    def __init__(self, config: ModelConfig, scale: float, rope_parameters: dict[str, Any],
                 sliding_window: int | None = None, soft_cap: float | None = None, qk_norm: bool = False):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        bias = bool(config.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads, config.num_key_value_heads,
                                          bias=bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, rope_parameters)
        self.attn = Attention(self.num_heads, head_dim, scale, self.num_kv_heads, sliding_window=sliding_window,
                              logits_soft_cap=soft_cap)
        self.has_qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        qk_norm = (self.q_norm, self.k_norm) if self.has_qk_norm else None
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb, qk_norm=qk_norm))
