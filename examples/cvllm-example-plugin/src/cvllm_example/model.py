"""TinyGPT: a small pre-norm decoder written from cvllm's layers by a third party.

It differs from Llama on purpose, to show what a plugin author controls: multi-head attention
(as many K/V heads as query heads), a plain GELU MLP (``fc_in`` -> gelu -> ``fc_out``, with
biases) instead of a gated SiLU one, and GPT-style parameter names under ``transformer.``::

    transformer.wte.weight
    transformer.h.{i}.ln_1.weight
    transformer.h.{i}.attn.{q,k,v,o}_proj.weight
    transformer.h.{i}.ln_2.weight
    transformer.h.{i}.mlp.fc_in.{weight,bias}
    transformer.h.{i}.mlp.fc_out.{weight,bias}
    transformer.ln_f.weight
    lm_head.weight                                  (untied from wte)

Each block is ``h = x + attn(ln_1(x)); out = h + mlp(ln_2(h))`` with RMSNorm and neox-style rotary
embeddings on q and k. ``cvllm_example.reference`` computes the same thing in plain torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.config import ModelConfig
from cvllm.layers import (
    Attention,
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
)
from cvllm.weight_loading import load_weights_by_name

# config.json "hidden_act" -> the `approximate` argument of torch's gelu
GELU_VARIANTS = {"gelu": "none", "gelu_pytorch_tanh": "tanh"}


class TinyGPTAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, head_dim, heads = config.hidden_size, config.head_dim, config.num_attention_heads
        # The checkpoint keeps q_proj, k_proj and v_proj apart; cvllm runs them as one matmul.
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, heads, heads)
        self.o_proj = RowParallelLinear(heads * head_dim, hidden)
        self.q_size = self.qkv_proj.num_heads * head_dim  # this rank's share under tensor parallelism
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, config.rope_parameters)
        # The paged KV cache and the kernels behind it belong to cvllm; the model only declares heads.
        num_heads = self.qkv_proj.num_heads
        self.attn = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads=num_heads)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.q_size, dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class TinyGPTMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        act = config.get("hidden_act", "gelu")
        if act not in GELU_VARIANTS:
            raise ValueError(f"unsupported hidden_act {act!r} for TinyGPT (expected one of {sorted(GELU_VARIANTS)})")
        self.approximate = GELU_VARIANTS[act]
        self.fc_in = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.fc_out = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


class TinyGPTBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.ln_1 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = TinyGPTAttention(config)
        self.ln_2 = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = TinyGPTMLP(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(positions, self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPTModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(TinyGPTBlock(config) for _ in range(config.num_hidden_layers))
        self.ln_f = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids)
        for block in self.h:
            x = block(positions, x)
        return self.ln_f(x)


class TinyGPTForCausalLM(nn.Module):
    """The class cvllm builds for ``"architectures": ["TinyGPTForCausalLM"]``."""

    # checkpoint name fragment -> (fused parameter it goes into, shard id for that layer's weight_loader)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError("TinyGPT uses multi-head attention: num_key_value_heads must equal num_attention_heads")
        self.config = config
        self.transformer = TinyGPTModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat varlen batch: ``input_ids`` and ``positions`` are ``[num_tokens]``; returns
        ``[num_tokens, hidden_size]``. Block tables and slot mapping reach ``Attention`` through
        cvllm's forward context, not through arguments."""
        return self.transformer(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Returns the parameter names that were loaded; cvllm reports any that are missing."""
        return load_weights_by_name(self, weights, self.packed_modules_mapping)
