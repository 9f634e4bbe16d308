"""StableLM (transformers' modeling_stablelm: StableLM-3B-4E1T, StableLM-2 1.6B and 12B, StableLM-Zephyr), built
from cvllm's parallel layers.

LayerNorms with biases, a neox rotary over the first ``partial_rotary_factor`` (0.25 unless the config says) of
each head, ``head_dim`` always hidden_size / heads, a SiLU-gated MLP, and three switches:

- ``use_qkv_bias``: biases on q/k/v (never on o_proj);
- ``qk_layernorm``: each head of q and of k goes through a LayerNorm of its own (weight, no bias) before rotary;
- ``use_parallel_residual``: attention and MLP both read the input norm's output, ``x + attn(ln(x)) + mlp(ln(x))``,
  and the layer has no post_attention_layernorm.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from cvllm.checkpoint.lazy import materialize
from cvllm.config import ModelConfig
from cvllm.distributed import tp_rank
from cvllm.layers import (
    Attention,
    LayerNorm,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    get_rope,
)
from cvllm.layers.decoder import DecoderOnlyForCausalLM
from cvllm.layers.layernorm import layer_norm_per_head
from cvllm.weight_loading import WeightTransform

# transformers' StableLmConfig default, for configs that name no partial_rotary_factor
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


class PerHeadLayerNorm(nn.Module):
    """A LayerNorm weight per head, stored as transformers stores them (``norms.{head}.weight``, every head of the
    model, so checkpoints load by name); this rank normalises its ``num_heads`` heads from ``first_head`` on, with
    their weights stacked once loaded (one op a call, not one per head)."""

    def __init__(self, head_dim: int, total_heads: int, first_head: int, num_heads: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(LayerNorm(head_dim, eps, bias=False) for _ in range(total_heads))
        self.head_dim, self.first_head, self.num_heads, self.eps = head_dim, first_head, num_heads, eps
        self.stacked_weight: torch.Tensor | None = None   # [num_heads, head_dim]

    def after_weights_loaded(self) -> None:
        mine = self.norms[self.first_head: self.first_head + self.num_heads]
        self.stacked_weight = torch.stack([norm.weight for norm in mine])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stacked_weight is None:
            self.after_weights_loaded()
        # fp32 and one rounding at the end, as nn.LayerNorm's kernel computes a low-precision input (one kernel on
        # backends that fuse it)
        return layer_norm_per_head(x, self.stacked_weight, self.eps)


class StableLmAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, total_heads, total_kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        head_dim = hidden // total_heads   # transformers' StableLM ignores a config head_dim
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, total_heads, total_kv_heads,
                                          bias=bool(config.get("use_qkv_bias", False)))
        self.o_proj = RowParallelLinear(total_heads * head_dim, hidden, bias=False)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rope = {"partial_rotary_factor": DEFAULT_PARTIAL_ROTARY_FACTOR, **config.rope_parameters}
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, rope)
        self.attn = Attention(self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads)
        self.qk_layernorm = bool(config.get("qk_layernorm", False))
        if self.qk_layernorm:
            eps, kv_rank = config.get("layer_norm_eps", 1e-5), tp_rank() // self.qkv_proj.kv_replicas
            self.q_layernorm = PerHeadLayerNorm(head_dim, total_heads, tp_rank() * self.num_heads, self.num_heads, eps)
            self.k_layernorm = PerHeadLayerNorm(head_dim, total_kv_heads, kv_rank * self.num_kv_heads,
                                                self.num_kv_heads, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb))


class StableLmMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act '{config.hidden_act}' for StableLM (expected silu)")
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter])
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class StableLmDecoderLayer(nn.Module):
    """Pre-norm, the residual carried beside the hidden state (core's PreNormDecoderLayer, with LayerNorms)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-5)
        self.use_parallel_residual = bool(config.get("use_parallel_residual", False))
        self.self_attn = StableLmAttention(config)
        self.mlp = StableLmMLP(config)
        self.input_layernorm = LayerNorm(config.hidden_size, eps)
        if not self.use_parallel_residual:
            self.post_attention_layernorm = LayerNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(positions, hidden)
        if self.use_parallel_residual:
            # transformers sums (x + attn) + mlp: the next norm adds the MLP's output to x + attn, in that order
            return self.mlp(hidden), residual + attn_out
        hidden, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(hidden), residual


class StableLmModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(StableLmDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.get("layer_norm_eps", 1e-5))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


def split_stacked_head_norms(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """GGUF files hold each layer's per-head q/k norms stacked, ``q_layernorm.weight`` [heads, head_dim] (llama.cpp's
    converter stacks them); the model keeps transformers' one tensor a head. A checkpoint's own per-head tensors
    (``q_layernorm.norms.0.weight``) do not match this transform's name and load as they are."""
    stem = name.removesuffix(".weight")
    for head, weight in enumerate(materialize(tensor)):
        yield f"{stem}.norms.{head}.weight", weight


class StableLmForCausalLM(DecoderOnlyForCausalLM):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def make_model(self, config: ModelConfig) -> nn.Module:
        return StableLmModel(config)

    def weight_transforms(self) -> dict[str, WeightTransform]:
        return {".q_layernorm.weight": split_stacked_head_norms, ".k_layernorm.weight": split_stacked_head_norms}
