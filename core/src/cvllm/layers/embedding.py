"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary (and narrows a
lazy checkpoint tensor to it before reading, ``checkpoint/lazy.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.checkpoint.lazy import LazyTensor, lazy_aware, materialize
from cvllm.distributed import all_gather_last_dim, all_reduce, tp_rank, tp_size
from cvllm.layers.quantization import dense


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // self.tp_size)  # ceil: the last rank's slice is zero-padded
        self.vocab_start = self.tp_rank * self.per_rank
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # a quantizer's method for this table (``set_table_method``): it holds the rows as it likes and computes the
        # lookup (``embed``) and, for an LM head or one tied to this table, the logits (``apply``)
        self.quant_method = None
        self.tied_heads: list[ParallelLMHead] = []   # heads that read this table (tie_to)
        self.tied_to: list[VocabParallelEmbedding] = []   # a head's: the table it reads (a list: not a submodule)

    def set_table_method(self, method) -> None:
        """Keep the table in ``method``'s form (a quantized checkpoint's own blocks): it creates the parameters the
        checkpoint loads into, as a LinearMethod does for a [per_rank, embedding_dim] weight. Called on the meta
        model, before loading; heads tied to this table drop their share of the float weight and read it here."""
        dtype = self.weight.dtype
        del self.weight
        for head in self.tied_heads:
            del head.weight
        self.quant_method = method
        method.create_weights(self, self.embedding_dim, self.per_rank, dtype)

    @lazy_aware
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | LazyTensor) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding: checkpoint shape {tuple(loaded.shape)} != "
                             f"model shape ({self.num_embeddings}, {param.shape[1]})")
        # the last ranks' slices may run past the vocabulary, or start after it (many ranks, a small vocabulary)
        start = min(self.vocab_start, self.num_embeddings)
        part = loaded.narrow(0, start, min(self.per_rank, self.num_embeddings - start))
        param.data[: part.shape[0]].copy_(materialize(part))
        param.data[part.shape[0]:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:   # given only at tensor-parallel size 1
            return self.quant_method.embed(self, input_ids)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; ``tie_to`` shares the input embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False):
        super().__init__(num_embeddings, embedding_dim)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight
        self.tied_to = [embedding]
        embedding.tied_heads.append(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        table = self.tied_to[0] if self.tied_to else self
        if table.quant_method is not None:   # the quantized table's own matmul (a quantizer's set_table_method)
            logits = table.quant_method.apply(table, hidden, self.bias)
        else:
            logits = dense(hidden, self.weight, self.bias)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)


def takes_table_method(module: nn.Module) -> bool:
    """Whether ``module`` is a table that may be given a quantizer's method (``set_table_method``): an embedding or
    LM head at tensor-parallel size 1 whose class computes as these do (not one that reads its weight in its own way,
    e.g. a scaled embedding), and not a head tied to another table (that table's method serves it)."""
    if not isinstance(module, VocabParallelEmbedding) or module.tp_size != 1 or module.tied_to:
        return False
    if isinstance(module, ParallelLMHead):
        return type(module).compute_logits is ParallelLMHead.compute_logits
    return type(module).forward is VocabParallelEmbedding.forward
