"""One tensor-parallel rank's shard built in this process, and what its loading read of each checkpoint tensor: the
tests that show a rank reads only its part. Loading needs no process group (only the forward pass communicates),
so every rank of a world can be built here, one after the other."""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
from torch import nn

from cvllm.checkpoint.base import Checkpoint
from cvllm.checkpoint.lazy import Box, LazyTensor


def counting_reads(checkpoint: Checkpoint) -> tuple[Checkpoint, Counter]:
    """The checkpoint with every lazy tensor's reads counted: name -> bytes its reader returned (a tensor yielded
    already read counts whole, when it is yielded)."""
    reads: Counter = Counter()

    def counted(name: str, reader):
        def read(box: Box) -> torch.Tensor:
            out = reader(box)
            reads[name] += out.nbytes
            return out
        return read

    def weights():
        for name, tensor in checkpoint.weight_iterator():
            if isinstance(tensor, LazyTensor):
                yield name, LazyTensor(tensor.shape, tensor.dtype, counted(name, tensor.reader), tensor.box)
            else:
                reads[name] += tensor.nbytes
                yield name, tensor

    return dataclasses.replace(checkpoint, weight_iterator=weights), reads


def build_rank(checkpoint: Checkpoint, rank: int, size: int, dtype: torch.dtype = torch.float32,
               isq: str | None = None) -> nn.Module:
    """Rank ``rank`` of ``size``'s model, loaded on the CPU backend as a tensor-parallel worker loads it."""
    from cvllm.backends.cpu import CpuBackend
    from cvllm.distributed import set_tensor_parallel
    from cvllm.engine.model_runner import build_model

    set_tensor_parallel(rank, size)
    try:
        return build_model(checkpoint, CpuBackend(), dtype, isq=isq)
    finally:
        set_tensor_parallel(0, 1)


def shard_mismatches(model: nn.Module, full: nn.Module, rank: int, size: int) -> list[str]:
    """The Llama-shaped weights of ``model`` (rank ``rank`` of ``size``) that are not ``full``'s (world size 1)
    narrowed to that rank: embedding and LM head rows, each layer's q/k/v heads (K/V heads replicated when fewer
    than the ranks), o_proj's and down_proj's columns, gate/up rows. A quantized layer compares its ``weight``,
    the dequantized compute form of the exact (float32) path."""
    cfg = full.config
    d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q, kv = heads * d // size, max(1, kv_heads // size) * d
    kv_rank = rank // max(1, size // kv_heads)
    inter, vocab = cfg.intermediate_size // size, cfg.vocab_size // size

    def rows(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return t[start:start + n]

    def columns(t: torch.Tensor, start: int, n: int) -> torch.Tensor:
        return t[:, start:start + n]

    pairs = {"model.embed_tokens": (model.model.embed_tokens.weight,
                                    rows(full.model.embed_tokens.weight, rank * vocab, vocab))}
    if not cfg.get("tie_word_embeddings", False):
        pairs["lm_head"] = (model.lm_head.weight, rows(full.lm_head.weight, rank * vocab, vocab))
    k_start, v_start = heads * d, (heads + kv_heads) * d
    for i, (ours, whole) in enumerate(zip(model.model.layers, full.model.layers)):
        qkv, gate_up = whole.self_attn.qkv_proj.weight, whole.mlp.gate_up_proj.weight
        pairs[f"layers.{i}.qkv_proj"] = (ours.self_attn.qkv_proj.weight, torch.cat([
            rows(qkv, rank * q, q), rows(qkv, k_start + kv_rank * kv, kv), rows(qkv, v_start + kv_rank * kv, kv)]))
        pairs[f"layers.{i}.o_proj"] = (ours.self_attn.o_proj.weight, columns(whole.self_attn.o_proj.weight,
                                                                             rank * q, q))
        pairs[f"layers.{i}.gate_up_proj"] = (ours.mlp.gate_up_proj.weight, torch.cat([
            rows(gate_up, rank * inter, inter), rows(gate_up, cfg.intermediate_size + rank * inter, inter)]))
        pairs[f"layers.{i}.down_proj"] = (ours.mlp.down_proj.weight, columns(whole.mlp.down_proj.weight,
                                                                            rank * inter, inter))
    return [name for name, (ours, expected) in pairs.items() if not torch.equal(ours, expected)]
