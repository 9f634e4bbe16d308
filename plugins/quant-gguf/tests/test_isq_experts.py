"""``--isq`` quantizes MoE experts too (cvllm_gguf/moe.py): each expert's values become its quantized values, on the
CPU as dequantized floats, on CUDA as stacked low-bit planes the fused MoE kernel reads (here through Triton's
interpreter): both give the same tokens."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.layers import FusedMoE
from cvllm.testing.checkpoints import make_checkpoint
from cvllm_gguf.dequant import dequantize
from cvllm_gguf.quantize import quantize

PROMPTS = [[5, 17, 33, 2, 90, 1, 44], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


def greedy(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6,
                                                                                   ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe")
    model = make_checkpoint(path, "qwen3_moe", norm_topk_prob=True)
    return path, model


def test_isq_rounds_the_experts_to_their_quantized_values(moe_checkpoint):
    path, model = moe_checkpoint
    llm = LLM(str(path), isq="q8_0", dtype="float32", num_kv_blocks=32)
    try:
        layer = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE))
        assert type(layer.quant_method).__name__ == "ISQFusedMoEMethod"
        original = model.model.layers[0].mlp.experts.down_proj[3]          # [H, I], transformers' layout
        want = dequantize(quantize(original.float(), "q8_0"), "q8_0", original.shape)
        assert torch.equal(layer.w2_weight[3].cpu(), want) and not torch.equal(want, original)
        assert len(greedy(llm)[0]) == 6
    finally:
        llm.shutdown()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the planes path on CPU tensors: interpreter")
def test_planes_path_gives_the_cpu_paths_tokens(moe_checkpoint, monkeypatch):
    pytest.importorskip("cvllm_cuda")
    from cvllm_gguf import moe

    path, _ = moe_checkpoint
    options = dict(isq="q8_0", dtype="float32", num_kv_blocks=32)
    llm = LLM(str(path), **options)
    want = greedy(llm)
    llm.shutdown()
    monkeypatch.setattr(moe, "plane_kernels_usable", lambda device: True)   # as on a CUDA device
    llm = LLM(str(path), **options)
    try:
        layer = next(m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedMoE))
        assert layer.quant_method.planes is not None and layer.w13_weight.numel() == 0   # no float experts
        assert greedy(llm) == want
    finally:
        llm.shutdown()
