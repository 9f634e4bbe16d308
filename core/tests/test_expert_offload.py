"""Expert offload (``num_experts_offload_per_rank``): K experts of every MoE layer in host memory, copied into
shared staging slots when routed. Token for token what the model gives without offload (one rank and two), the
resident experts really fewer, and the routing really reaching the host experts."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM
from cvllm.layers import FusedMoE
from cvllm.layers.expert_offload import OffloadedFusedMoEMethod
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint

PROMPTS = [[5, 17, 33, 2, 90, 1, 44], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100]]
OPTIONS = dict(dtype="float32", num_kv_blocks=64)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    make_checkpoint(path, "qwen3_moe", norm_topk_prob=True)   # 8 experts, top-2, 2 layers
    return path


def test_offloaded_experts_give_the_same_tokens(moe_checkpoint):
    want = cvllm_greedy(moe_checkpoint, PROMPTS, 10, **OPTIONS)
    llm = LLM(str(moe_checkpoint), num_experts_offload_per_rank=3, **OPTIONS)
    try:
        layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
        assert len(layers) == 2
        routed_to_host = 0
        for layer in layers:
            method = layer.quant_method
            assert isinstance(method, OffloadedFusedMoEMethod) and method.resident == 5
            assert layer.w13_weight.shape[0] == 5 and method.host13.shape[0] == 3
            layer.enable_expert_counts()
        from cvllm import SamplingParams

        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
        for layer in layers:
            routed_to_host += int(layer.expert_counts[5:].sum())
        assert routed_to_host > 0   # the host experts did run
    finally:
        llm.shutdown()


def test_every_expert_on_the_host_and_two_ranks(moe_checkpoint):
    want = cvllm_greedy(moe_checkpoint, PROMPTS, 6, **OPTIONS)
    assert cvllm_greedy(moe_checkpoint, PROMPTS, 6, num_experts_offload_per_rank=8, **OPTIONS) == want
    assert cvllm_greedy(moe_checkpoint, PROMPTS, 6, num_experts_offload_per_rank=2, tensor_parallel_size=2,
                        **OPTIONS) == want


def test_negative_counts_are_refused():
    from cvllm.engine.config import EngineConfig

    with pytest.raises(ValueError, match="num_experts_offload_per_rank"):
        EngineConfig(model="x", num_experts_offload_per_rank=-1)


def test_quantized_experts_are_refused():
    from cvllm.layers.expert_offload import offload_experts
    from cvllm.layers.fused_moe_methods import FusedMoEMethod

    class Other(FusedMoEMethod):
        def create_weights(self, layer, num_experts, hidden_size, intermediate_local, dtype):
            pass

    with torch.device("cpu"):
        layer = FusedMoE(4, 2, 8, 8, method=Other())
    with pytest.raises(NotImplementedError, match="unquantized experts only"):
        offload_experts(torch.nn.ModuleList([layer]), 1, torch.device("cpu"))

