"""GPTQ and AWQ MoE checkpoints (cvllm_marlin/moe.py): the experts' qweight / qzeros / scales / g_idx load into the
fused MoE layer and compute what a float checkpoint of the dequantized weights computes (float32, bit for bit), on
one rank, over two (experts split on the intermediate dimension, or whole experts per rank); on CUDA they become
stacked low-bit planes, checked here through the Triton interpreter against the dequantized experts."""

from __future__ import annotations

import pytest
import torch
from marlin_reference import awq_tensors, gptq_tensors, rtn, write_float, write_quantized

from cvllm.testing.checkpoints import cvllm_greedy, greedy_logprobs, make_checkpoint
from cvllm_marlin.config import AWQConfig, GPTQConfig
from cvllm_marlin.moe import PackedExpertsMethod
from cvllm_marlin.packing import dequantize_awq, dequantize_gptq

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    make_checkpoint(path, "qwen3_moe", seed=2)
    return path


def pair(base, tmp_path, fmt: str, **options):
    """(the quantized checkpoint, a float checkpoint of its dequantized weights)."""
    state = write_quantized(base, tmp_path / fmt, fmt, **options)
    write_float(base, tmp_path / "float", state)
    return tmp_path / fmt, tmp_path / "float"


def moe_methods(path, **options) -> set[str]:
    from cvllm import LLM
    from cvllm.layers.fused_moe import FusedMoE

    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, **options)
    try:
        return {type(m.quant_method).__name__ for m in llm.llm_engine.runner.model.modules()
                if isinstance(m, FusedMoE)}
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("fmt", "options"), [("gptq", {}), ("gptq", {"desc_act": True}), ("gptq", {"bits": 8}),
                                              ("awq", {})], ids=["gptq", "gptq-act-order", "gptq-8bit", "awq"])
def test_quantized_experts_compute_their_dequantized_weights(base, tmp_path, fmt, options):
    quantized, reference = pair(base, tmp_path, fmt, **options)
    ours, kinds = greedy_logprobs(quantized, PROMPTS, 8, dtype="float32", num_kv_blocks=32)
    assert kinds == {f"{fmt.upper()}LinearMethod", "UnquantizedLinearMethod"}   # the router stays float
    assert moe_methods(quantized) == {"PackedExpertsMethod"}
    theirs, _ = greedy_logprobs(reference, PROMPTS, 8, dtype="float32", num_kv_blocks=32)
    assert ours == theirs


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tensor-parallel-experts", "expert-parallel"])
def test_two_ranks_match_one(base, tmp_path, expert_parallel):
    quantized, _ = pair(base, tmp_path, "gptq")
    one = cvllm_greedy(quantized, PROMPTS, 8, dtype="float32", num_kv_blocks=32)
    two = cvllm_greedy(quantized, PROMPTS, 8, dtype="float32", num_kv_blocks=32, tensor_parallel_size=2,
                       enable_expert_parallel=expert_parallel)
    assert two == one


def test_a_missing_part_names_the_expert(base, tmp_path):
    from safetensors.torch import load_file, save_file

    from cvllm.checkpoint.base import CheckpointError

    quantized, _ = pair(base, tmp_path, "gptq")
    state = load_file(quantized / "model.safetensors")
    del state["model.layers.1.mlp.experts.5.up_proj.scales"]
    save_file(state, quantized / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises((CheckpointError, ValueError), match=r"layers\.1\.mlp\.experts\.5\.up_proj: the checkpoint "
                                                            r"lacks scales"):
        moe_methods(quantized)


@pytest.mark.parametrize("fmt", ["gptq", "awq", "gptq-act-order"])
def test_planes_compute_the_dequantized_experts(fmt):
    """The CUDA form (stacked planes, fused-MoE planes kernel; here in Triton's interpreter) against core's grouped
    float experts on the same dequantized weights."""
    pytest.importorskip("cvllm_cuda")
    from cvllm.layers.fused_moe import FusedMoE
    from cvllm.layers.fused_moe_methods import grouped_experts
    from cvllm_cuda.kernels.fused_moe_planes import fused_moe_planes

    experts, hidden, inter, group = 4, 64, 32, 32
    act_order = fmt == "gptq-act-order"
    fmt = fmt.removesuffix("-act-order")
    config = AWQConfig(bits=4, group_size=group) if fmt == "awq" else GPTQConfig(
        bits=4, group_size=group, sym=True, desc_act=act_order, zero_offset=1)
    method = PackedExpertsMethod(fmt, config, "model.layers.0.mlp.experts")
    layer = FusedMoE(experts, 2, hidden, inter, method=method)
    gen = torch.Generator().manual_seed(4)
    dense = {"w1": [], "w3": [], "w2": []}
    for e in range(experts):
        for shard, (out, inp) in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            perm = torch.randperm(inp, generator=gen) if act_order else None   # each expert its own order
            quant = rtn(torch.randn(out, inp, generator=gen) * 0.05, 4, group, True, perm, awq=fmt == "awq")
            tensors = awq_tensors(quant) if fmt == "awq" else gptq_tensors(quant, 4)
            for part, tensor in tensors.items():
                method.load_expert_part(layer, part, tensor, shard, e)
            dense[shard].append(dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group)
                                if fmt == "awq" else
                                dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"],
                                                tensors["g_idx"], 4, 1))
    gate, up, down, perms = method.expert_planes(layer)
    assert (perms == [None] * 3) != act_order
    w13 = torch.stack([torch.cat([g, u]) for g, u in zip(dense["w1"], dense["w3"])])
    w2 = torch.stack(dense["w2"])
    x = torch.randn(5, hidden, generator=gen)
    weights = torch.rand(5, 2, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(5)])
    ours = fused_moe_planes(x, [gate, up], down, weights, ids, layer.act_fn, perms)
    theirs = grouped_experts(x, w13, w2, layer.act_fn, weights, ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_isq_gptq_quantizes_experts_too(base, tmp_path):
    """``--isq gptq`` on an unquantized MoE checkpoint: the experts are rounded to nearest after loading, as the
    dense layers are while loading (the router stays float); the result is what a float checkpoint of the rounded
    weights computes."""
    from safetensors.torch import load_file

    from cvllm_marlin.isq import GROUP_SIZES
    from cvllm_marlin.rtn import quantize_rtn

    state = load_file(base / "model.safetensors")
    for name, tensor in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"):
            group = next(g for g in GROUP_SIZES if tensor.shape[1] % g == 0)
            state[name] = quantize_rtn(tensor, 4, group, sym=True).dequantized()
    write_float(base, tmp_path / "rtn", state)
    ours, _ = greedy_logprobs(base, PROMPTS, 8, dtype="float32", num_kv_blocks=32, isq="gptq")
    assert moe_methods(base, isq="gptq") == {"PackedExpertsMethod"}
    theirs, _ = greedy_logprobs(tmp_path / "rtn", PROMPTS, 8, dtype="float32", num_kv_blocks=32)
    assert ours == theirs


def test_isq_gptq_experts_over_two_ranks(tmp_path):
    # every projection's inputs, and each rank's part of o_proj's and the experts' down_proj's, whole groups of 128:
    # the same rounding on one rank and on two (as in real models)
    make_checkpoint(tmp_path / "base", "qwen3_moe", seed=2, hidden_size=256, head_dim=64, moe_intermediate_size=256)
    one = cvllm_greedy(tmp_path / "base", PROMPTS, 8, dtype="float32", num_kv_blocks=32, isq="gptq")
    two = cvllm_greedy(tmp_path / "base", PROMPTS, 8, dtype="float32", num_kv_blocks=32, isq="gptq",
                       tensor_parallel_size=2)
    assert two == one
