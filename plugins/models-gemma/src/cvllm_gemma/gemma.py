"""Gemma (1), as in Hugging Face's modeling_gemma, built from cvllm's parallel layers.

Llama's pre-norm layout with Gemma's three changes: RMSNorms that scale by ``1 + weight`` (in fp32), token
embeddings multiplied by sqrt(hidden_size) (rounded to the activations' dtype first), a GeGLU MLP (tanh GELU);
the LM head is tied to the embedding. The model and causal-LM classes here are the skeleton Gemma 2 and 3 reuse,
each choosing its own layers (``make_layer``) and final logit soft-cap.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from cvllm.checkpoint import materialize
from cvllm.config import ModelConfig
from cvllm.distributed import tp_size
from cvllm.layers import ParallelLMHead
from cvllm.layers.decoder import DecoderStack, PreNormDecoderLayer
from cvllm.weight_loading import load_weights_by_name
from cvllm_gemma.gguf_adapter import NORM_SHIFT
from cvllm_gemma.layers import GemmaAttention, GemmaMLP, GemmaRMSNorm, GemmaScaledEmbedding, soft_cap


class GemmaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm, the residual carried beside the hidden state, with Gemma's (1 + w) RMSNorms."""

    norm_class = GemmaRMSNorm


class GemmaModel(DecoderStack):
    """``embed_tokens`` (scaled), the ``layers`` that ``make_layer(config, index)`` builds, ``norm``."""

    norm_class = GemmaRMSNorm
    embedding_class = GemmaScaledEmbedding


class GemmaForCausalLM(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig):
        super().__init__()
        config = self.text_config(config)
        if config.num_key_value_heads % tp_size() and tp_size() % config.num_key_value_heads:
            raise ValueError("num_key_value_heads must divide or be divisible by the tensor-parallel size")
        self.config = config
        self.tied = bool(config.get("tie_word_embeddings", True))  # every published Gemma ties its LM head
        self.final_logit_softcapping = self.final_soft_cap(config)
        self.prepare(config)
        self.model = GemmaModel(config, self.make_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if self.tied:
            self.lm_head.tie_to(self.model.embed_tokens)

    # ---- what each generation chooses ----

    def text_config(self, config: ModelConfig) -> ModelConfig:
        """The config of the text model (Gemma 3's multimodal checkpoints nest it)."""
        return config

    def final_soft_cap(self, config: ModelConfig) -> float | None:
        return None

    def prepare(self, config: ModelConfig) -> None:
        """Work out what ``make_layer`` needs per layer (windows, rope) before the layers are built."""

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        # transformers 5 reads hidden_act and takes the legacy "gelu" of the published configs as the tanh GELU
        activation = config.get("hidden_act") or "gelu_pytorch_tanh"
        activation = "gelu_pytorch_tanh" if activation == "gelu" else activation
        attention = GemmaAttention(config, config.head_dim**-0.5, config.rope_parameters)
        return GemmaDecoderLayer(config, attention, GemmaMLP(config, activation))

    # ---- the model interface ----

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return soft_cap(self.lm_head.compute_logits(hidden), self.final_logit_softcapping)

    def checkpoint_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under this model's names, minus a tied LM head's copy (the embedding is it),
        the norms' weights as offsets from 1 (a GGUF file holds 1 + w: gguf_adapter.py)."""
        shift = self.config.get(NORM_SHIFT, 0.0)
        for name, tensor in weights:
            if self.tied and name == "lm_head.weight":
                continue
            if shift and name.endswith("norm.weight"):
                tensor = materialize(tensor) - shift
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_weights_by_name(self, self.checkpoint_weights(weights), self.packed_modules_mapping)
