"""Expert parallelism on the CPU (gloo, 2 ranks, ``enable_expert_parallel``): the tiny Qwen3-MoE and Qwen2-MoE
checkpoints give one rank's greedy tokens, rank 0 holds half the experts whole while attention and Qwen2-MoE's
shared expert stay tensor-parallel, and an expert count the ranks do not divide is refused with the sizes that
would. The checkpoints and the greedy helper are test_tensor_parallel.py's."""

from __future__ import annotations

import pytest

from cvllm import LLM
from cvllm.testing.checkpoints import MOE_CONFIG, cvllm_greedy, make_checkpoint

PROMPTS = [[1, 5, 9, 23, 7, 11, 3, 4, 99, 100, 17, 2, 8], [4, 8, 15, 16, 23, 42]]
EXPERTS = MOE_CONFIG["num_experts"]   # 8, moe_intermediate_size 32


def greedy(path, tensor_parallel_size: int, **options) -> list[list[int]]:
    return cvllm_greedy(path, PROMPTS, 8, tensor_parallel_size=tensor_parallel_size, num_kv_blocks=32, **options)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_two_expert_parallel_ranks_match_one(tmp_path, arch):
    make_checkpoint(tmp_path, arch)
    assert greedy(tmp_path, 2, enable_expert_parallel=True) == greedy(tmp_path, 1)


def test_prefill_chunks_and_decodes_mixed(tmp_path):
    """Steps of 4 tokens: prompt chunks beside decodes, so some steps route only a few pairs to each rank."""
    make_checkpoint(tmp_path, "qwen3_moe")
    assert greedy(tmp_path, 2, enable_expert_parallel=True, max_num_batched_tokens=4) == greedy(tmp_path, 1)


def test_rank_zero_holds_half_the_experts_whole(tmp_path):
    model = make_checkpoint(tmp_path, "qwen2_moe")   # 4 heads of 16, 2 KV heads; shared expert of 48
    llm = LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=32)
    try:
        layer = llm.llm_engine.runner.model.model.layers[0]
        experts, shared = layer.mlp.experts, layer.mlp.shared_expert
        assert experts.num_local_experts == EXPERTS // 2
        assert tuple(experts.w13_weight.shape) == (EXPERTS // 2, 2 * 32, 64)   # experts 0..3, all of I
        want = model.model.layers[0].mlp.experts.gate_up_proj[: EXPERTS // 2].float()   # transformers' [E, 2I, H]
        assert (experts.w13_weight - want).abs().max() == 0
        assert experts.w2_weight.shape[0] == EXPERTS // 2
        assert shared.down_proj.weight.shape[1] == 48 // 2                  # still tensor-parallel
        assert layer.self_attn.qkv_proj.weight.shape[0] == (4 + 2 * 2) * 16 // 2
    finally:
        llm.shutdown()


def test_expert_count_the_ranks_do_not_divide(tmp_path):
    make_checkpoint(tmp_path, "qwen3_moe", num_experts=3)
    with pytest.raises(ValueError, match=r"3 experts do not split evenly over 2 ranks; "
                                         r"tensor_parallel_size values that would: 1, 3"):
        LLM(str(tmp_path), tensor_parallel_size=2, enable_expert_parallel=True, num_kv_blocks=32)
    assert greedy(tmp_path, 2) == greedy(tmp_path, 1)   # without it, each expert shards: 2 ranks work
