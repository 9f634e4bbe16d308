"""GPTQ and AWQ checkpoints under tensor parallelism (CPU, gloo, 2 ranks): the same greedy tokens as one rank in
float32; each rank's layers hold (and read) only their part of the packed tensors, by whole groups along the input;
a row-parallel split inside a group is refused with an error that says so."""

from __future__ import annotations

import pytest
import torch
from marlin_reference import write_quantized

from cvllm import plugins
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint
from cvllm.testing.shards import build_rank, counting_reads, shard_mismatches
from cvllm_marlin.linear_method import ShardError

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]

# hidden 64, 4 heads of 16, 2 KV heads, intermediate 128: over 2 ranks o_proj keeps 32 inputs, down_proj 64
CASES = {
    "gptq-g32-asym": ("gptq", {"bits": 4, "group_size": 32, "sym": False}),
    "gptq-g32-act-order": ("gptq", {"bits": 4, "group_size": 32, "sym": False, "desc_act": True}),
    "awq-g32": ("awq", {"bits": 4, "group_size": 32}),
}


def quantized(tmp_path, case, **overrides):
    fmt, options = CASES[case]
    make_checkpoint(tmp_path / "base", "llama", **overrides)
    write_quantized(tmp_path / "base", tmp_path / fmt, fmt, **options)
    return tmp_path / fmt


def greedy(path, size: int) -> list[list[int]]:
    return cvllm_greedy(path, PROMPTS, 8, tensor_parallel_size=size, dtype="float32", num_kv_blocks=32)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_one(tmp_path, case):
    path = quantized(tmp_path, case)
    assert greedy(path, 2) == greedy(path, 1)


@pytest.mark.parametrize("case, overrides", [
    ("gptq-g32-act-order", {}),
    ("awq-g32", {}),
    ("gptq-g32-asym", {"num_key_value_heads": 1}),    # one KV head, replicated on both ranks
], ids=["gptq-act-order", "awq", "gptq-kv1"])
def test_each_rank_holds_and_reads_its_part(tmp_path, case, overrides):
    path = quantized(tmp_path, case, **overrides)
    checkpoint = plugins.open_checkpoint(str(path))
    full = build_rank(checkpoint, 0, 1)
    for rank in range(2):
        counted, reads = counting_reads(checkpoint)
        model = build_rank(counted, rank, 2)
        assert shard_mismatches(model, full, rank, 2) == []     # the dequantized weights are full's narrowed
        prefix = "model.layers.0"
        for module in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
            assert reads[f"{prefix}.{module}.qweight"] * 2 == _nbytes(checkpoint, f"{prefix}.{module}.qweight")
        # row-parallel down_proj: its groups' scales only, except under act-order (any input, any group)
        down_scales = reads[f"{prefix}.mlp.down_proj.scales"] * (1 if case.endswith("act-order") else 2)
        assert down_scales == _nbytes(checkpoint, f"{prefix}.mlp.down_proj.scales")


def _nbytes(checkpoint, name: str) -> int:
    return next(tensor.nbytes for key, tensor in checkpoint.weights(lazy=True) if key == name)


def test_row_split_inside_a_group_is_refused(tmp_path):
    make_checkpoint(tmp_path / "base", "llama")
    write_quantized(tmp_path / "base", tmp_path / "gptq", "gptq", bits=4, group_size=64)
    checkpoint = plugins.open_checkpoint(str(tmp_path / "gptq"))
    with pytest.raises(ShardError, match=r"o_proj: a row-parallel split over 2 tensor-parallel ranks gives each "
                                         r"rank 32 of the 64 input features.*group_size 64"):
        build_rank(checkpoint, 0, 2)
    # act-order keeps every group on every rank: the same split loads
    write_quantized(tmp_path / "base", tmp_path / "act", "gptq", bits=4, group_size=64, desc_act=True)
    model = build_rank(plugins.open_checkpoint(str(tmp_path / "act")), 1, 2)
    assert model.model.layers[0].self_attn.o_proj.weight.shape == (64, 32)
    assert torch.isfinite(model.model.layers[0].self_attn.o_proj.weight).all()
