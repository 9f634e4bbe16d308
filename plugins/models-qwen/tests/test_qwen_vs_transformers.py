"""cvllm's Qwen2 and Qwen3 against transformers 5.24 on tiny random checkpoints.

Prompt logits match within fp32 tolerance and greedy generations token for token, through the paged KV
cache with batching, chunked prefill and preemption (each mechanism test checks the engine's counters).
Qwen2's sliding window applies only on layers >= max_window_layers; the test shows it would catch a window
applied on every layer or on none.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A window smaller than every prompt below, on layers 1 and 2 of 3 (max_window_layers=1).
WINDOW = 8
SLIDING = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1, "num_hidden_layers": 3}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # QwQ / R1-Distill-Qwen shape: Qwen2, GQA, a large rope base, config as published
    "qwen2": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    "qwen2_tied_v5": ("qwen2", {"spelling": "v5", "shards": 2, "tie_word_embeddings": True}),
    "qwen2_sliding": ("qwen2", SLIDING),                           # no layer_types: the rule decides
    "qwen2_sliding_v5": ("qwen2", {"spelling": "v5", **SLIDING}),  # layer_types written by transformers 5
    "qwen3": ("qwen3", {"head_dim": 32}),                           # head_dim != hidden_size / heads
    "qwen3_bias_v5": ("qwen3", {"spelling": "v5", "attention_bias": True, "tie_word_embeddings": True}),
}


def _checkpoint(qwen_checkpoint, name: str):
    arch, kwargs = CASES[name]
    return qwen_checkpoint(arch, **kwargs)


@pytest.fixture(params=sorted(CASES))
def case(request, qwen_checkpoint):
    return _checkpoint(qwen_checkpoint, request.param)


def test_prompt_logits_match(case, harness) -> None:
    prompts = harness.prompts((7, 23, 50), seed=11)
    diff = harness.max_logits_diff(harness.llm(case), case.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_greedy_matches_in_one_batch(case, harness) -> None:
    # 11, 26 and 40 are longer than the window and span several KV blocks
    prompts = harness.prompts((5, 11, 26, 40), seed=118)
    want = harness.oracle_greedy(case.model, prompts)
    llm = harness.llm(case)
    assert harness.greedy(llm, prompts) == want
    # all prompts ran side by side: one at a time would take a step per generated token
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS


# ---- sliding window ----


def _set_windows(llm, windows: list[int | None]) -> None:
    for layer, window in zip(llm.llm_engine.runner.model.model.layers, windows, strict=True):
        layer.self_attn.attn.sliding_window = window


@pytest.mark.parametrize("name", ["qwen2_sliding", "qwen2_sliding_v5"])
def test_sliding_window_only_from_max_window_layers(qwen_checkpoint, harness, name: str) -> None:
    checkpoint = _checkpoint(qwen_checkpoint, name)
    assert checkpoint.model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    # the published spelling leaves the layers to the max_window_layers rule, transformers 5's lists them
    saved = json.loads((checkpoint.path / "config.json").read_text())
    assert ("layer_types" in saved) == name.endswith("_v5")
    prompts = harness.prompts((20, 37), seed=21)
    assert min(map(len, prompts)) > WINDOW
    llm = harness.llm(checkpoint)
    layers = llm.llm_engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [None, WINDOW, WINDOW]
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL
    # the comparison tells the rule apart from its two likely mistakes
    for wrong in ([WINDOW] * 3, [None] * 3):
        _set_windows(llm, wrong)
        assert harness.max_logits_diff(llm, checkpoint.model, prompts) > 100 * harness.LOGITS_ATOL, wrong


def test_sliding_window_needs_use_sliding_window(qwen_checkpoint, harness) -> None:
    checkpoint = qwen_checkpoint("qwen2", **{**SLIDING, "use_sliding_window": False})
    llm = harness.llm(checkpoint)
    assert [layer.self_attn.attn.sliding_window for layer in llm.llm_engine.runner.model.model.layers] == [None] * 3
    assert harness.max_logits_diff(llm, checkpoint.model, harness.prompts((30,), seed=22)) < harness.LOGITS_ATOL


def test_chunked_prefill_logits_with_sliding_window(qwen_checkpoint, harness) -> None:
    # chunks of 8 tokens: each chunk attends to K/V that earlier chunks left in the cache, through the window
    checkpoint = _checkpoint(qwen_checkpoint, "qwen2_sliding")
    llm = harness.llm(checkpoint, max_num_batched_tokens=8, block_size=8)
    diff = harness.max_logits_diff(llm, checkpoint.model, harness.prompts((45,), seed=17))
    assert llm.llm_engine.stats.prefill_chunks == 5
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


# ---- engine mechanisms, on Qwen3 ----


def test_chunked_prefill(qwen_checkpoint, harness) -> None:
    checkpoint = _checkpoint(qwen_checkpoint, "qwen3")
    budget = 16
    prompts = harness.prompts((5, 40, 13, 29), seed=15)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=budget)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


@pytest.mark.parametrize("name", ["qwen3", "qwen2_sliding"])
def test_preemption(qwen_checkpoint, harness, name: str) -> None:
    harness.check_preemption(_checkpoint(qwen_checkpoint, name))
