"""Phi-2 (and Phi-1/1.5), as in Hugging Face's modeling_phi, built from cvllm's parallel layers.

One LayerNorm (with a bias) feeds attention and the MLP side by side, and a layer's output is their sum plus the
residual. Rotary covers the first ``partial_rotary_factor`` of each head; q/k/v and ``dense`` have biases; the
MLP is ``fc1`` -> GELU (the config's ``hidden_act``) -> ``fc2`` with biases; a final LayerNorm and an LM head with
a bias close the model. ``qk_layernorm`` (a LayerNorm over each head of q and k before rotary) is honoured.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.config import ModelConfig
from cvllm.distributed import tp_size
from cvllm.layers import (
    Attention,
    ColumnParallelLinear,
    LayerNorm,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from cvllm.weight_loading import load_weights_by_name

# transformers' ACT2FN names for Phi's MLP -> F.gelu's approximation ("gelu_new" is the tanh formula)
GELU_APPROXIMATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}
# PhiConfig's defaults where config.json names none
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5
DEFAULT_LAYER_NORM_EPS = 1e-5


def layer_norm(config: ModelConfig, size: int) -> LayerNorm:
    return LayerNorm(size, config.get("layer_norm_eps", DEFAULT_LAYER_NORM_EPS))


class PhiAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, config.num_attention_heads, config.num_key_value_heads,
                                          bias=True)
        self.dense = RowParallelLinear(config.num_attention_heads * head_dim, hidden, bias=True)
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rope = {"partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR, **config.rope_parameters}
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, rope)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)
        self.q_layernorm = self.k_layernorm = None
        if config.get("qk_layernorm", False):
            self.q_layernorm = layer_norm(config, head_dim)
            self.k_layernorm = layer_norm(config, head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)      # [T, H*D]
            k = self.k_layernorm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        return self.dense(self.attn(q, k, v, positions, self.rotary_emb))


class PhiMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        act = config.get("hidden_act", "gelu_new")
        if act not in GELU_APPROXIMATIONS:
            raise ValueError(f"unsupported hidden_act '{act}' for Phi (expected one of: "
                             f"{', '.join(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[act]
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc2 = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class PhiDecoderLayer(nn.Module):
    """``attn(norm(x)) + mlp(norm(x)) + x``, with the residual carried beside the output: the next layer's norm
    adds it (the order of transformers' sums, so the same rounding)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = layer_norm(config, config.hidden_size)
        self.self_attn = PhiAttention(config)
        self.mlp = PhiMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(positions, normed) + self.mlp(normed), residual


class PhiModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(PhiDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.final_layernorm = layer_norm(config, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.final_layernorm(hidden, residual)
        return hidden


class PhiForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_key_value_heads % tp_size() and tp_size() % config.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide or be divisible by the tensor-parallel size")
        self.config = config
        self.model = PhiModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, bias=True)
        if config.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.get("tie_word_embeddings", False)
        weights = ((n, t) for n, t in weights if not (tied and n == "lm_head.weight"))
        return load_weights_by_name(self, weights, self.packed_modules_mapping)
