"""A GGUF checkpoint (the Mac path's usual model: the demo is one) through the metal backend on the CPU, against the
CPU backend: same greedy tokens and prompt logits, with prefill chunks over the paged cache.

On the CPU cvllm-gguf computes Q4_0/Q4_1 layers with torch's int4-packed CPU matmul and dequantizes the rest, for
either backend alike. On MPS (CVLLM_METAL_TEST_DEVICE=mps, on a Mac) it dequantizes every layer to bf16, so the
logits may differ by bf16 roundings there: a looser bound, never run (docs/metal.md)."""

from __future__ import annotations

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing.requirements import import_or_skip

import_or_skip("cvllm_gguf.testing")   # cvllm-gguf and its test extra (gguf): a skip locally, an error in CI

from cvllm_gguf.quantize import quantize  # noqa: E402
from cvllm_gguf.testing import VOCAB, write_tiny_llama  # noqa: E402
from cvllm_metal.backend import MetalBackend  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 12


def quantized_rows(qtype, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """GGML blocks of random weights, quantized by cvllm-gguf (so every scale is finite and of a real size)."""
    weights = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.2
    return quantize(weights, qtype)


def test_gguf_model_matches_the_cpu_backend(tmp_path, metal_device):
    path, _, _ = write_tiny_llama(tmp_path, quantized_rows)   # Q8_0, Q4_1, Q5_0/Q5_1 and Q4_K layers
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (5, 23, 40)]
    tokens, logits = {}, {}
    for backend in ("metal", "cpu"):
        llm = LLM(model=str(path), backend=backend, dtype="float32", block_size=8, num_kv_blocks=64,
                  max_num_batched_tokens=16)   # the 23- and 40-token prompts prefill in chunks
        try:
            engine_backend = llm.llm_engine.backend
            assert (backend == "metal") == isinstance(engine_backend, MetalBackend)
            assert engine_backend.device.type == (metal_device.type if backend == "metal" else "cpu")
            params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
            logits[backend] = [x.cpu() for x in llm.llm_engine.prompt_logits(prompts)]
            assert llm.llm_engine.stats.prefill_chunks > 0
        finally:
            llm.shutdown()
    assert tokens["metal"] == tokens["cpu"]
    assert len({tuple(t) for t in tokens["cpu"]}) == len(prompts)   # three distinct continuations
    tol = 1e-4 if metal_device.type == "cpu" else 5e-2
    for got, want in zip(logits["metal"], logits["cpu"]):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
