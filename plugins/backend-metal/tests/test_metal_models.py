"""Whole models through the metal backend, on the CPU (CVLLM_METAL_ON_CPU=1, set by conftest.py's metal_device),
against transformers on tiny random checkpoints: greedy tokens equal and prompt logits within fp32 tolerance,
through the paged cache with batching, chunked prefill next to decodes, prefix caching and preemption, each
mechanism checked to have fired. The model families come from their plugins (cvllm-llama, cvllm-qwen,
cvllm-deepseek), installed with this one in CI."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from cvllm.testing import Harness, checkpoint_factory
from cvllm.testing.requirements import import_or_skip
from cvllm_metal.backend import MetalBackend

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class MetalHarness(Harness):
    """cvllm.testing's oracle harness with every engine on the metal backend (named, not left to priority)."""
    ENGINE_DEFAULTS: ClassVar[dict[str, Any]] = {**Harness.ENGINE_DEFAULTS, "backend": "metal"}


harness = MetalHarness()

# name -> (tiny architecture, config overrides, the plugin that serves it)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama_gqa": ("llama", {}, "cvllm_llama"),
    "mistral_sliding": ("mistral", {"sliding_window": 16}, "cvllm_llama"),   # prompts longer than the window
    "qwen3": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}, "cvllm_qwen"),   # per-head q/k norms
    "deepseek_v2": ("deepseek_v2", {}, "cvllm_deepseek"),   # MLA: one latent cache is both K and V
}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return checkpoint_factory(tmp_path_factory)


def checkpoint(tiny, name: str):
    arch, overrides, plugin = CASES[name]
    import_or_skip(plugin)   # a skip locally, an error under CI=true
    return tiny(arch, **overrides)


def metal_llm(ckpt, device, **overrides: Any):
    llm = harness.llm(ckpt, **overrides)
    backend = llm.llm_engine.backend
    assert isinstance(backend, MetalBackend) and backend.device.type == device.type
    return llm


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_and_logits_match_transformers(tiny, metal_device, name):
    ckpt = checkpoint(tiny, name)
    prompts = harness.prompts((5, 11, 26, 40), seed=100)   # 26 and 40: past the sliding window, several blocks
    want = harness.oracle_greedy(ckpt.model, prompts, max_new_tokens=12)
    llm = metal_llm(ckpt, metal_device)
    try:
        assert harness.greedy(llm, prompts, max_tokens=12) == want
        # MLA's absorbed attention multiplies in another order than transformers' (its own tests allow 2e-5
        # relative); the tiny logits here are a few units, so the plain fp32 bound covers it
        assert harness.max_logits_diff(llm, ckpt.model, prompts[2:]) < harness.LOGITS_ATOL
    finally:
        llm.shutdown()


def test_chunked_prefill_beside_decodes_and_prefix_caching(tiny, metal_device):
    """Prefill chunks of at most 16 tokens share steps with decodes; later prompts reuse the first one's cached
    prefix blocks (a prefill chunk over a cached prefix: the varlen path with context)."""
    ckpt = checkpoint(tiny, "llama_gqa")
    prefix = harness.prompts((40,), seed=17)[0]   # two full blocks of 16 and a partial one
    prompts = [prefix + suffix for suffix in harness.prompts((3, 12, 20), seed=1017)]
    want = harness.oracle_greedy(ckpt.model, prompts)
    llm = metal_llm(ckpt, metal_device, max_num_batched_tokens=16)
    try:
        got = harness.greedy(llm, prompts[:1]) + harness.greedy(llm, prompts[1:])
        stats = llm.llm_engine.stats
    finally:
        llm.shutdown()
    assert got == want
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"
    assert stats.prefix_hit_tokens >= 2 * 32, "the later prompts did not reuse the cached prefix"


def test_preemption(tiny, metal_device):
    harness.check_preemption(checkpoint(tiny, "llama_gqa"))   # asserts preemptions > 0 itself
