"""Phi-3 with LongRoPE, its switch at position 32 (original_max_position_embeddings) so that prompts cross it.

cvllm picks the factors per position (short below 32, long from 32 on); transformers per sequence (long for every
position once the sequence is longer than 32: its forward pass switches, and its generate recomputes the cache
when a generation grows past 32). So, as cvllm_phi/phi3.py documents:
- sequences of at most 32 tokens (prompt and generation) give transformers' logits and greedy tokens;
- longer ones follow a per-position reference instead: transformers' own model and longrope factors with a
  rotary that picks the factors per position (conftest's PerPositionLongRope); transformers' logits differ, and
  the test says so. Chunked prefill and preemption reproduce the reference exactly, since a position's angles
  never depend on the rest of the sequence.
Swapping the two factor lists, or never switching, would be caught.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from cvllm.layers import get_rope
from cvllm_phi.phi3 import phi3_rope_parameters

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the switch at position 32, so that prompts cross it; factors far apart, so that a mix-up shows
ORIGINAL_MAX = 32


def longrope(rotary_dim: int, spelling: str = "longrope") -> dict[str, Any]:
    half = rotary_dim // 2
    return {"rope_type": spelling, "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 2.0 * i for i in range(half)]}


CASES: dict[str, dict[str, Any]] = {
    # Phi-3-mini-128k's layout: rope_scaling type "longrope", original_max_position_embeddings at the top level
    "longrope": {"original_max_position_embeddings": ORIGINAL_MAX, "rope_parameters": longrope(16)},
    # Phi-4-mini's: 3/4 of each head rotated, tied embeddings; the older type name "su"
    "su_partial_tied": {"original_max_position_embeddings": ORIGINAL_MAX, "partial_rotary_factor": 0.75,
                        "tie_word_embeddings": True, "rope_parameters": longrope(12, spelling="su")},
}


@pytest.fixture(params=sorted(CASES))
def case(request, phi_checkpoint):
    return phi_checkpoint("phi3", **CASES[request.param])


def test_config_as_published(case) -> None:
    raw = json.loads((case.path / "config.json").read_text())
    assert raw["original_max_position_embeddings"] == ORIGINAL_MAX
    assert raw["rope_scaling"]["type"] in ("longrope", "su")
    assert "original_max_position_embeddings" not in raw["rope_scaling"]


def test_inside_the_original_context_matches_transformers(case, harness) -> None:
    prompts = harness.prompts((7, 19, ORIGINAL_MAX), seed=31)
    diff = harness.max_logits_diff(harness.llm(case), case.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_greedy_inside_the_original_context_matches_transformers(case, harness) -> None:
    prompts = harness.prompts((5, 10, 16), seed=32)   # + 16 new tokens: at most 32 positions, all short
    want = harness.oracle_greedy(case.model, prompts)
    assert harness.greedy(harness.llm(case), prompts) == want


def test_greedy_across_the_switch_follows_the_per_position_reference(case, harness, longrope_reference) -> None:
    # 20 and 30 + 16 new tokens decode past position 32: here the cached keys below 32 keep their short angles;
    # transformers' generate instead recomputes the whole sequence with the long factors at that point
    prompts = harness.prompts((10, 20, 30), seed=32)
    want = harness.oracle_greedy(longrope_reference(case), prompts)
    assert harness.greedy(harness.llm(case), prompts) == want


def test_prompts_past_the_switch_follow_the_per_position_reference(case, harness, longrope_reference) -> None:
    prompts = harness.prompts((45, 70), seed=33)
    llm = harness.llm(case)
    diff = harness.max_logits_diff(llm, longrope_reference(case), prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"
    # the documented difference: transformers' single pass uses the long factors below the switch too
    assert harness.max_logits_diff(llm, case.model, prompts) > 100 * harness.LOGITS_ATOL


def test_greedy_past_the_switch_with_chunked_prefill(case, harness, longrope_reference) -> None:
    prompts = harness.prompts((45, 5, 70, 33), seed=34)
    want = harness.oracle_greedy(longrope_reference(case), prompts)
    llm = harness.llm(case, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    assert llm.llm_engine.stats.prefill_chunks > 0


def test_chunked_prefill_logits_across_the_switch(phi_checkpoint, harness, longrope_reference) -> None:
    # chunks of 8: the chunk holding positions 32..39 starts exactly at the switch
    checkpoint = phi_checkpoint("phi3", **CASES["longrope"])
    llm = harness.llm(checkpoint, max_num_batched_tokens=8, block_size=8)
    diff = harness.max_logits_diff(llm, longrope_reference(checkpoint), harness.prompts((45,), seed=35))
    assert llm.llm_engine.stats.prefill_chunks == 5
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_prefix_cache_across_the_switch(phi_checkpoint, harness, longrope_reference) -> None:
    # a 48-token prefix (3 blocks, past the switch) computed for the first prompt and reused by the second
    checkpoint = phi_checkpoint("phi3", **CASES["longrope"])
    prefix, tails = harness.prompts((48,), seed=38)[0], harness.prompts((5, 9), seed=39)
    prompts = [prefix + tail for tail in tails]
    want = harness.oracle_greedy(longrope_reference(checkpoint), prompts)
    llm = harness.llm(checkpoint)
    got = [harness.greedy(llm, [prompt])[0] for prompt in prompts]
    assert llm.llm_engine.stats.prefix_hit_tokens >= 48
    assert got == want


def test_preemption_across_the_switch(phi_checkpoint, harness, longrope_reference) -> None:
    checkpoint = phi_checkpoint("phi3", **CASES["longrope"])
    harness.check_preemption(checkpoint, oracle=longrope_reference(checkpoint))


def test_wrong_factors_would_show(phi_checkpoint, harness, longrope_reference) -> None:
    checkpoint = phi_checkpoint("phi3", **CASES["longrope"])
    llm = harness.llm(checkpoint)
    model = llm.llm_engine.runner.model
    params = phi3_rope_parameters(model.config)
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == ORIGINAL_MAX
    short_prompts, long_prompts = harness.prompts((30,), seed=36), harness.prompts((60,), seed=37)

    def use(rope_params: dict[str, Any]) -> None:
        rope = get_rope(16, model.config.max_position_embeddings, rope_params)
        for layer in model.model.layers:
            layer.self_attn.rotary_emb = rope

    use({**params, "short_factor": params["long_factor"], "long_factor": params["short_factor"]})
    assert harness.max_logits_diff(llm, checkpoint.model, short_prompts) > 100 * harness.LOGITS_ATOL
    use({**params, "long_factor": params["short_factor"]})   # never switching: right below 32, wrong past it
    assert harness.max_logits_diff(llm, checkpoint.model, short_prompts) < harness.LOGITS_ATOL
    assert harness.max_logits_diff(llm, longrope_reference(checkpoint), long_prompts) > 100 * harness.LOGITS_ATOL
