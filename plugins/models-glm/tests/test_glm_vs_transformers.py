"""cvllm's GLM-4 and GLM-4-0414 against transformers 5.24 on tiny random checkpoints.

Prompt logits match within fp32 tolerance and greedy generations token for token, through the paged KV cache
with batching, chunked prefill and preemption (each mechanism test checks the engine's counters). The rotary
tests show the comparison would catch the likely mistakes: neox halves instead of interleaved pairs, the whole
head rotated instead of its first part.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from cvllm.layers import get_rope
from cvllm_glm.glm import glm_rope_parameters

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # GLM-4-0414 as published: q/k/v biases, partial_rotary_factor at the top level, GQA
    "glm4": ("glm4", {}),
    # transformers 5's spelling, a quarter of the head rotated, head_dim != hidden / heads, tied, two shards
    "glm4_v5_quarter_rotary": ("glm4", {"rotary": "v5", "partial_rotary_factor": 0.25, "head_dim": 32,
                                        "tie_word_embeddings": True, "shards": 2}),
    # no partial_rotary_factor in config.json (transformers' default 0.5), no biases, one KV head a query head
    "glm4_default_rotary_no_bias": ("glm4", {"rotary": "absent", "attention_bias": False,
                                             "num_key_value_heads": 4}),
    # glm-4-9b: GLM-4's first layout, two norms a layer
    "glm": ("glm", {}),
}


def _checkpoint(glm_checkpoint, name: str):
    arch, kwargs = CASES[name]
    return glm_checkpoint(arch, **kwargs)


@pytest.fixture(params=sorted(CASES))
def case(request, glm_checkpoint):
    return _checkpoint(glm_checkpoint, request.param)


def _attentions(llm) -> list:
    return [layer.self_attn for layer in llm.llm_engine.runner.model.model.layers]


def test_prompt_logits_match(case, harness) -> None:
    prompts = harness.prompts((7, 23, 50), seed=11)
    diff = harness.max_logits_diff(harness.llm(case), case.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_greedy_matches_in_one_batch(case, harness) -> None:
    prompts = harness.prompts((5, 11, 26, 40), seed=102)   # 26 and 40 span several KV blocks
    want = harness.oracle_greedy(case.model, prompts)
    llm = harness.llm(case)
    assert harness.greedy(llm, prompts) == want
    # all prompts ran side by side: one at a time would take a step per generated token
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS


def test_config_spellings(glm_checkpoint) -> None:
    """The cases really spell the rotary fraction in the three ways (so each reading path is tested)."""
    def saved(name: str) -> dict[str, Any]:
        return json.loads((_checkpoint(glm_checkpoint, name).path / "config.json").read_text())

    hub, v5, absent = saved("glm4"), saved("glm4_v5_quarter_rotary"), saved("glm4_default_rotary_no_bias")
    assert hub["partial_rotary_factor"] == 0.5 and hub["rope_scaling"] is None
    assert v5["rope_parameters"]["partial_rotary_factor"] == 0.25 and "partial_rotary_factor" not in v5
    assert "partial_rotary_factor" not in absent and absent["rope_scaling"] is None


@pytest.mark.parametrize(("name", "rotary_dim"), [("glm4", 8), ("glm4_v5_quarter_rotary", 8),
                                                  ("glm4_default_rotary_no_bias", 8), ("glm", 8)])
def test_rotary_layout(glm_checkpoint, harness, name: str, rotary_dim: int) -> None:
    llm = harness.llm(_checkpoint(glm_checkpoint, name))
    for attention in _attentions(llm):
        assert attention.rotary_emb.interleaved and attention.rotary_emb.rotary_dim == rotary_dim


@pytest.mark.parametrize("wrong", ["neox halves", "whole head"])
def test_wrong_rotary_would_show(glm_checkpoint, harness, wrong: str) -> None:
    checkpoint = _checkpoint(glm_checkpoint, "glm4")
    prompts = harness.prompts((20, 37), seed=21)
    llm = harness.llm(checkpoint)
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL
    attentions = _attentions(llm)
    right = [attention.rotary_emb for attention in attentions]
    config = llm.llm_engine.runner.model.config
    rope = glm_rope_parameters(config) | ({"partial_rotary_factor": 1.0} if wrong == "whole head" else {})
    replacement = get_rope(config.head_dim, config.max_position_embeddings, rope, interleaved=wrong == "whole head")
    for attention in attentions:
        attention.rotary_emb = replacement
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) > 100 * harness.LOGITS_ATOL
    for attention, rotary in zip(attentions, right):
        attention.rotary_emb = rotary
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL


def test_fused_rotate_and_write_kv_gets_the_pairs(glm_checkpoint, harness) -> None:
    """A backend's rotary_write_kv (CUDA's fused rotate-and-write-KV) is told to turn GPT-J pairs: a stand-in that
    rotates only when told so, then writes the cache, gives transformers' logits."""
    checkpoint = _checkpoint(glm_checkpoint, "glm4")
    llm = harness.llm(checkpoint)
    backend = llm.llm_engine.runner.backend
    rope = next(m for m in llm.llm_engine.runner.model.modules() if hasattr(m, "rotary_emb")).rotary_emb
    calls = []

    def pairs_only(positions, q, k, v, cos_sin, head_dim, k_cache, v_cache, slot_mapping, interleaved=False):
        assert interleaved, "GLM's rotary reached the fused kernel without interleaved=True"
        calls.append(1)
        q, k = rope(positions, q, k)
        heads = k_cache.shape[2]
        backend.write_kv(k.reshape(-1, heads, head_dim), v.reshape(-1, heads, head_dim), k_cache, v_cache,
                         slot_mapping)
        return q

    backend.rotary_write_kv = pairs_only
    assert harness.max_logits_diff(llm, checkpoint.model, harness.prompts((9,), seed=3)) < harness.LOGITS_ATOL
    assert calls


def test_chunked_prefill(glm_checkpoint, harness) -> None:
    checkpoint = _checkpoint(glm_checkpoint, "glm4")
    prompts = harness.prompts((5, 40, 13, 29), seed=15)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


def test_chunked_prefill_logits(glm_checkpoint, harness) -> None:
    # chunks of 8 tokens: each chunk attends to K/V that earlier chunks left in the cache
    checkpoint = _checkpoint(glm_checkpoint, "glm4_v5_quarter_rotary")
    llm = harness.llm(checkpoint, max_num_batched_tokens=8, block_size=8)
    diff = harness.max_logits_diff(llm, checkpoint.model, harness.prompts((45,), seed=17))
    assert llm.llm_engine.stats.prefill_chunks == 5
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


@pytest.mark.parametrize("name", ["glm4", "glm"])
def test_preemption(glm_checkpoint, harness, name: str) -> None:
    harness.check_preemption(_checkpoint(glm_checkpoint, name))


def test_two_ranks_give_transformers_tokens(glm_checkpoint, harness) -> None:
    """Tensor parallel over two CPU ranks (gloo): each rank takes its rows of both halves of the fused gate_up_proj."""
    from cvllm.testing.checkpoints import cvllm_greedy

    checkpoint = _checkpoint(glm_checkpoint, "glm4")
    prompts = harness.prompts((9, 21), seed=4)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    assert cvllm_greedy(checkpoint.path, prompts, harness.NEW_TOKENS, dtype="float32", num_kv_blocks=32,
                        tensor_parallel_size=2) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_with_graphs_matches(case, harness) -> None:
    """On the CUDA backend with CUDA graphs (issue 20 item 6): the partial GPT-J rotary through the fused rotary
    + KV write, four norms."""
    harness.check_cuda(case, harness.prompts((5, 11, 26, 40), seed=102))
