"""Expert offload on the GPU (``num_experts_offload_per_rank``): the host experts in pinned memory, copied into the
staging slots when routed; token for token what the same CUDA engine gives without offload (bf16, the backend's
fused MoE kernels on both sides)."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.layers import FusedMoE
from cvllm.testing.checkpoints import cvllm_greedy, make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 33, 2, 90, 1, 44], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100]]
OPTIONS = dict(backend="cuda", dtype="bfloat16", num_kv_blocks=64, max_num_seqs=4)


def test_offloaded_experts_on_the_gpu_give_the_same_tokens(tmp_path):
    make_checkpoint(tmp_path, "qwen3_moe", norm_topk_prob=True)   # 8 experts, top-2, 2 layers
    want = cvllm_greedy(tmp_path, PROMPTS, 10, **OPTIONS)
    llm = LLM(str(tmp_path), num_experts_offload_per_rank=3, **OPTIONS)
    try:
        layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE)]
        for layer in layers:
            method = layer.quant_method
            assert method.host13.device.type == "cpu" and method.host13.is_pinned() and method.host2.is_pinned()
            assert layer.w13_weight.device.type == "cuda" and layer.w13_weight.shape[0] == 5
            layer.enable_expert_counts()
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
        assert [list(o.outputs[0].token_ids) for o in outputs] == want
        assert sum(int(layer.expert_counts[5:].sum()) for layer in layers) > 0   # the host experts did run
    finally:
        llm.shutdown()
