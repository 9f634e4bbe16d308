"""Each tensor-parallel rank reads only its shard of a safetensors checkpoint (cvllm/checkpoint/lazy.py). The ranks
are built in this process (loading needs no process group) with every checkpoint tensor's reads counted: rank r of
2 reads half the bytes of each split weight and all of a replicated one (norms, the MoE router, K/V heads fewer than
the ranks), world size 1 reads each tensor once, whole, and each shard holds the full model's weight narrowed."""

from __future__ import annotations

import pytest
import torch

from cvllm import plugins
from cvllm.testing.checkpoints import make_checkpoint
from cvllm.testing.shards import build_rank, counting_reads, shard_mismatches


def replicated(name: str, kv_heads: int) -> bool:
    return ("norm" in name or name.endswith(".mlp.gate.weight")
            or kv_heads < 2 and name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")))


@pytest.mark.parametrize("arch, options", [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 1}),          # 1 KV head over 2 ranks: k/v read whole by both
    ("qwen2", {}),                                  # q/k/v biases: split like their weights
    ("qwen3_moe", {}),                              # per-expert 2-D tensors
    ("qwen3_moe", {"fused_experts": True}),         # stacked [E, 2I, H] / [E, H, I]: chunked, then narrowed
], ids=["llama", "llama-kv1", "qwen2", "qwen3-moe", "qwen3-moe-fused"])
def test_each_rank_reads_its_half_of_each_split_weight(tmp_path, arch, options):
    make_checkpoint(tmp_path, arch, **options)
    checkpoint = plugins.open_checkpoint(str(tmp_path))
    sizes = {name: tensor.nbytes for name, tensor in checkpoint.weight_iterator()}   # shapes only: nothing read
    kv_heads = options.get("num_key_value_heads", 2)

    counted, reads = counting_reads(checkpoint)
    build_rank(counted, 0, 1)
    assert dict(reads) == sizes
    for rank in (0, 1):
        counted, reads = counting_reads(checkpoint)
        build_rank(counted, rank, 2)
        assert dict(reads) == {name: size if replicated(name, kv_heads) else size // 2 for name, size in sizes.items()}


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_each_shard_is_the_full_weight_narrowed(tmp_path, kv_heads):
    make_checkpoint(tmp_path, num_key_value_heads=kv_heads)
    checkpoint = plugins.open_checkpoint(str(tmp_path))
    full = build_rank(checkpoint, 0, 1)
    for rank in (0, 1):
        assert shard_mismatches(build_rank(checkpoint, rank, 2), full, rank, 2) == []


def test_in_situ_quantization_reads_and_quantizes_each_ranks_half(tmp_path):
    """ISQ quantizes the floats a rank keeps, not the whole weight: the blocks equal the full model's, narrowed."""
    make_checkpoint(tmp_path)
    checkpoint = plugins.open_checkpoint(str(tmp_path))
    sizes = {name: tensor.nbytes for name, tensor in checkpoint.weight_iterator()}
    full = build_rank(checkpoint, 0, 1, isq="q8_0").model.layers[0]
    for rank in (0, 1):
        counted, reads = counting_reads(checkpoint)
        layer = build_rank(counted, rank, 2, isq="q8_0").model.layers[0]
        assert dict(reads) == {name: size if "norm" in name else size // 2 for name, size in sizes.items()}
        # Q8_0: 34 bytes per 32 columns; down_proj's 128 columns are 4 blocks, 2 per rank
        assert torch.equal(layer.mlp.down_proj.qweight, full.mlp.down_proj.qweight[:, rank * 68:][:, :68])
        assert torch.equal(layer.self_attn.qkv_proj.qweight[:32], full.self_attn.qkv_proj.qweight[rank * 32:][:32])
