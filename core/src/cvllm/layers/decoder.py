"""The decoder skeleton most model families share: pre-norm layers with the residual carried beside the hidden
state (so the backend's fused add + RMSNorm does both), between a token embedding and a final norm.

    hidden, residual = input_layernorm(hidden [+ residual])
    hidden = self_attn(positions, hidden)
    hidden, residual = post_attention_layernorm(hidden + residual)
    hidden = mlp(hidden)

The attribute names are Hugging Face's (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``;
``embed_tokens``, ``layers``, ``norm``), so checkpoints load by name. A family builds its own attention and MLP per
layer and hands them in; ``DecoderOnlyForCausalLM`` is the LM shell around it (plugins/models-deepseek, -gemma,
-phi, -glm and -stablelm use them; Llama and Qwen keep their own copies of the same code).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from cvllm.config import ModelConfig
from cvllm.distributed import tp_size
from cvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from cvllm.layers.layernorm import RMSNorm
from cvllm.weight_loading import WeightTransform, load_weights_by_name, transform_weights


def feed(producer: nn.Module | None, consumer: nn.Module | None) -> None:
    """Record that ``producer`` (an RMSNorm, a SiluAndMul, an Attention) hands its output straight to the linear
    layer ``consumer``, as it is, not written in place in between (``producer.feeds``): a backend may then make the
    consumer's input form in the producer's launch (Backend.takes_feeds). A plain attribute, not a submodule: the
    consumer stays where the model tree has it (one name, one state-dict entry). Nothing where either is missing."""
    if producer is not None and consumer is not None and hasattr(producer, "feeds"):
        object.__setattr__(producer, "feeds", consumer)


class PreNormDecoderLayer(nn.Module):
    norm_class = RMSNorm   # a subclass's own norm, built as norm_class(hidden_size, rms_norm_eps) (Gemma's 1 + w)

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        # the norms' outputs go straight to the attention's and the MLP's first projections, the attention's to the
        # output projection, the gated activation's to the down projection, in the families built on this layer
        # (where a module has other names, nothing is linked)
        feed(self.input_layernorm, getattr(self_attn, "qkv_proj", None))
        feed(self.post_attention_layernorm, getattr(mlp, "gate_up_proj", None))
        feed(getattr(mlp, "act_fn", None), getattr(mlp, "down_proj", None))
        feed(getattr(self_attn, "attn", None), getattr(self_attn, "o_proj", None))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderStack(nn.Module):
    """``embed_tokens``, the ``layers`` ``make_layer(config, index)`` builds, ``norm``."""

    norm_class = RMSNorm                        # as PreNormDecoderLayer's
    embedding_class = VocabParallelEmbedding    # built as embedding_class(vocab_size, hidden_size)

    def __init__(self, config: ModelConfig, make_layer: Callable[[ModelConfig, int], nn.Module]):
        super().__init__()
        self.embed_tokens = self.embedding_class(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderOnlyForCausalLM(nn.Module):
    """The causal-LM shell around a decoder: ``model`` (``make_model``: a DecoderStack of ``make_layer``'s layers by
    default), ``lm_head`` tied to the token embedding where the config says, ``forward`` and ``compute_logits``.
    A family supplies ``make_layer`` (or ``make_model``). Loading takes the checkpoint's tensors without a tied
    head's copy (``untied``), through the family's ``weight_transforms()`` (weight_loading.transform_weights: a
    fused or stacked tensor cut into what the layers load) and maps them with ``loading_mapping`` (the names after
    the transforms; ``packed_modules_mapping``, the checkpoint's own, by default); a family may override
    ``load_weights`` instead."""

    # the checkpoint tensors that pack into one layer, by the names the checkpoint stores (what the quantizers look
    # up); a family whose transforms rename tensors sets loading_mapping too
    packed_modules_mapping: dict[str, tuple[str, object]] = {}

    def __init__(self, config: ModelConfig):
        super().__init__()
        kv_heads, ranks = config.num_key_value_heads, tp_size()
        if kv_heads % ranks and ranks % kv_heads:
            raise ValueError(f"{kv_heads} KV heads neither divide nor are divided by {ranks} tensor-parallel ranks")
        self.config = config
        self.model = self.make_model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.get("tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)
        feed(getattr(self.model, "norm", None), self.lm_head)   # the final norm's output goes to the head

    def make_model(self, config: ModelConfig) -> nn.Module:
        return DecoderStack(config, self.make_layer)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def weight_transforms(self) -> dict[str, WeightTransform]:
        """{name fragment: transform} for the checkpoint tensors that do not load as they are (none here)."""
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapping = getattr(self, "loading_mapping", None) or self.packed_modules_mapping
        return load_weights_by_name(self, transform_weights(self.untied(weights), self.weight_transforms()), mapping)

    def untied(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors without ``lm_head.weight`` when the head is tied (some files repeat it)."""
        tied = self.config.get("tie_word_embeddings", False)
        return ((name, tensor) for name, tensor in weights if not (tied and name == "lm_head.weight"))
