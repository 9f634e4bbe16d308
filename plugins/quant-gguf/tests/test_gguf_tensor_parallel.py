"""A GGUF checkpoint under tensor parallelism (2 ranks, gloo): the workers get the checkpoint pickled (the file
re-mapped, its header not scanned again), quantized linears shard by whole blocks, and a row-parallel split
that falls inside a block (Q4_K's 256 columns over 2 ranks) loads each rank's columns dequantized. In float32
(the exact path) the greedy tokens equal one rank's. Each rank copies only its part of the file's bytes (ranks built
in this process, ``GGUFFile.read`` counted), and its shard is the full model's weights narrowed."""

from __future__ import annotations

import logging
import pickle
from collections import Counter

import pytest
import torch

from cvllm import LLM, plugins
from cvllm.checkpoint.lazy import materialize
from cvllm.sampling_params import SamplingParams
from cvllm.testing.shards import build_rank, shard_mismatches
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.reader import GGUFFile
from cvllm_gguf.testing import write_tiny_llama

PROMPTS = [[5, 17, 33, 2], [90, 1, 44, 44, 3, 8, 61, 12, 70, 9, 11, 4, 85, 30, 31, 32, 33, 50], [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def greedy(path, tensor_parallel_size: int) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=tensor_parallel_size, num_kv_blocks=32)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_weight_iterator_pickles_without_the_metadata(tmp_path, make_rows):
    path, _, _ = write_tiny_llama(tmp_path, make_rows)
    checkpoint = plugins.open_checkpoint(path)
    copy = pickle.loads(pickle.dumps(checkpoint.weight_iterator))
    ours, theirs = dict(checkpoint.weights()), {name: materialize(tensor) for name, tensor in copy()}
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert copy.args[0][0].file.metadata == {}   # the remapped file: tensors only


@pytest.mark.parametrize("types", [{}, {"down_proj": GGMLType.Q8_0}], ids=["q4k-down-unaligned", "aligned"])
def test_two_ranks_match_one_in_float32(tmp_path, make_rows, types, caplog, monkeypatch):
    import cvllm_gguf.linear_method

    monkeypatch.setattr(cvllm_gguf.linear_method, "_warned", set())   # logged once per process: an earlier test may
    path, _, _ = write_tiny_llama(tmp_path, make_rows, types=types)
    with caplog.at_level(logging.WARNING, logger="cvllm_gguf.linear_method"):
        two = greedy(path, 2)
    unaligned = "Q4_K rows of 256 columns split over 2 tensor-parallel ranks" in caplog.text
    assert unaligned == (not types)
    assert two == greedy(path, 1)


def test_rank_zero_holds_block_shards(tmp_path, make_rows):
    path, _, _ = write_tiny_llama(tmp_path, make_rows)   # hidden 64, 4 heads of 16, 2 KV heads, intermediate 256
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=32)
    try:
        layer = llm.llm_engine.runner.model.model.layers[0]
        qkv, o, down = layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj
        assert qkv.qweight.shape[0] == (4 + 2 * 2) * 16 // 2                  # Q4_1 rows: half of them
        assert o.qweight.shape[1] == 32 // 32 * 34 and o.weight.shape == (64, 32)   # Q8_0: one block of 32
        assert down.gguf_columns == (0, 128) and down.weight.shape == (64, 128)    # Q4_K: full rows kept
    finally:
        llm.shutdown()


@pytest.mark.parametrize("types, float_linears, whole", [
    ({}, (), ("ffn_down",)),   # raw blocks (q/k rows permuted in the file); Q4_K down split inside its blocks
    ({"v_proj": GGMLType.Q8_0, "down_proj": GGMLType.Q8_0}, ("o_proj",), ()),   # dequantized: q/k/v of two types
], ids=["blocks", "dequantized"])                                              # fuse as floats, o_proj is F16
def test_each_rank_reads_its_part_of_the_file(tmp_path, make_rows, monkeypatch, types, float_linears, whole):
    path, _, _ = write_tiny_llama(tmp_path, make_rows, types=types, float_linears=float_linears)
    checkpoint = plugins.open_checkpoint(path)
    sizes = {weight.info.name: weight.info.nbytes for weight in checkpoint.weight_iterator.args[0]}
    reads, read = Counter(), GGUFFile.read

    def counting(self, tensor, *args):
        out = read(self, tensor, *args)
        reads[tensor.name] += out.nbytes
        return out

    monkeypatch.setattr(GGUFFile, "read", counting)
    full = build_rank(checkpoint, 0, 1)
    assert dict(reads) == sizes
    for rank in (0, 1):
        reads.clear()
        model = build_rank(checkpoint, rank, 2)
        kept_whole = [name for name in sizes if "norm" in name or name.split(".")[-2] in whole]
        assert dict(reads) == {name: size if name in kept_whole else size // 2 for name, size in sizes.items()}
        assert shard_mismatches(model, full, rank, 2) == []


def test_demo_gguf_three_ranks_match_one(demo_gguf):
    """SmolLM2-135M: 9 heads, 3 KV heads, so 3 ranks (2 do not split the heads); Q4_1 splits on blocks."""
    prompts = [[1, 504, 3458, 314, 253, 2132], [28, 17, 9, 44]]
    tokens = {}
    for size in (3, 1):
        llm = LLM(str(demo_gguf), dtype="float32", tensor_parallel_size=size, num_kv_blocks=16)
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        finally:
            llm.shutdown()
        tokens[size] = [list(o.outputs[0].token_ids) for o in outputs]
    assert tokens[3] == tokens[1]
