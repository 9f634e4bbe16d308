"""cvllm's StableLM against transformers 5.24 on tiny random checkpoints.

Prompt logits match within fp32 tolerance and greedy generations token for token, through the paged KV cache
with batching, chunked prefill and preemption (each mechanism test checks the engine's counters). Every switch
(use_qkv_bias, qk_layernorm, use_parallel_residual) is exercised on and off, and the tests show the comparison
would catch the likely mistakes: one q/k norm weight for all heads, the wrong residual form, the whole head
rotated, interleaved pairs instead of neox halves.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from cvllm.layers import get_rope

pytestmark = pytest.mark.usefixtures("one_torch_thread")
# prompt seeds whose oracle runs keep every greedy step far from a near-tie
SEEDS = {"greedy": 118, "chunked": 15, "preemption": 17}
HEAD_DIM = 16   # the tiny model's hidden 64 over 4 heads

CASES: dict[str, dict[str, Any]] = {
    # StableLM-2-1.6B / Zephyr shape, as published: q/k/v biases, sequential residual, no q/k norms
    "stablelm2": {"use_qkv_bias": True},
    # StableLM-3B-4E1T shape: no biases, multi-head KV; config.json names no partial_rotary_factor (0.25)
    "stablelm3b_default_rotary": {"rotary": "absent", "num_key_value_heads": 4},
    # StableLM-2-12B shape: per-head q/k norms, parallel residual, no biases, GQA
    "stablelm2_12b": {"qk_layernorm": True, "use_parallel_residual": True},
    # the switches the published models do not combine, in transformers 5's spelling, half the head rotated,
    # tied, two shards
    "qk_norm_sequential_bias_v5": {"rotary": "v5", "qk_layernorm": True, "use_qkv_bias": True,
                                   "partial_rotary_factor": 0.5, "tie_word_embeddings": True, "shards": 2},
    "parallel_bias": {"use_parallel_residual": True, "use_qkv_bias": True},
}


@pytest.fixture(params=sorted(CASES))
def case(request, stablelm_checkpoint):
    return stablelm_checkpoint(**CASES[request.param])


def _layers(llm) -> list:
    return list(llm.llm_engine.runner.model.model.layers)


def test_prompt_logits_match(case, harness) -> None:
    prompts = harness.prompts((7, 23, 50), seed=11)
    diff = harness.max_logits_diff(harness.llm(case), case.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_greedy_matches_in_one_batch(case, harness) -> None:
    prompts = harness.prompts((5, 11, 26, 40), seed=SEEDS["greedy"])   # 26 and 40 span several KV blocks
    want = harness.oracle_greedy(case.model, prompts)
    llm = harness.llm(case)
    assert harness.greedy(llm, prompts) == want
    # all prompts ran side by side: one at a time would take a step per generated token
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS


def test_switches_reach_the_layers(stablelm_checkpoint, harness) -> None:
    for name, overrides in CASES.items():
        llm = harness.llm(stablelm_checkpoint(**overrides))
        factor = overrides.get("partial_rotary_factor", 0.25)
        for layer in _layers(llm):
            attention = layer.self_attn
            assert attention.rotary_emb.rotary_dim == int(HEAD_DIM * factor) and not attention.rotary_emb.interleaved
            assert (attention.qkv_proj.bias is not None) == overrides.get("use_qkv_bias", False), name
            assert attention.qk_layernorm == overrides.get("qk_layernorm", False), name
            parallel = overrides.get("use_parallel_residual", False)
            assert layer.use_parallel_residual == parallel and hasattr(layer, "post_attention_layernorm") != parallel


def test_config_spellings(stablelm_checkpoint) -> None:
    """The cases really spell the rotary fraction in the three ways (so each reading path is tested)."""
    def saved(name: str) -> dict[str, Any]:
        return json.loads((stablelm_checkpoint(**CASES[name]).path / "config.json").read_text())

    hub, v5, absent = saved("stablelm2"), saved("qk_norm_sequential_bias_v5"), saved("stablelm3b_default_rotary")
    assert hub["partial_rotary_factor"] == 0.25 and hub["rope_scaling"] is None
    assert v5["rope_parameters"]["partial_rotary_factor"] == 0.5 and "partial_rotary_factor" not in v5
    assert "partial_rotary_factor" not in absent and absent["rope_scaling"] is None


def _check_wrong_variant_shows(harness, llm, checkpoint, prompts, break_it, restore) -> None:
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL
    break_it()
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) > 100 * harness.LOGITS_ATOL
    restore()
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL


def test_per_head_norm_weights_matter(stablelm_checkpoint, harness) -> None:
    checkpoint = stablelm_checkpoint(**CASES["stablelm2_12b"])
    llm = harness.llm(checkpoint)
    norms = [norm for layer in _layers(llm) for norm in (layer.self_attn.q_layernorm, layer.self_attn.k_layernorm)]
    right = [norm.stacked_weight for norm in norms]
    assert all(not torch.equal(w[0], w[1]) for w in right), "the checkpoint's heads should differ"

    def first_head_for_all() -> None:
        for norm, weight in zip(norms, right):
            norm.stacked_weight = weight[:1].expand_as(weight)

    def restore() -> None:
        for norm, weight in zip(norms, right):
            norm.stacked_weight = weight

    _check_wrong_variant_shows(harness, llm, checkpoint, harness.prompts((20, 37), seed=21), first_head_for_all,
                               restore)


@pytest.mark.parametrize("name", ["stablelm2_12b", "stablelm2"])
def test_residual_form_matters(stablelm_checkpoint, harness, name: str) -> None:
    checkpoint = stablelm_checkpoint(**CASES[name])
    llm = harness.llm(checkpoint)
    layers = _layers(llm)
    parallel = layers[0].use_parallel_residual

    def other_form() -> None:
        for layer in layers:
            layer.use_parallel_residual = not parallel
            if parallel:   # sequential needs a second norm: the input norm's, the likeliest mix-up
                layer.post_attention_layernorm = layer.input_layernorm

    def restore() -> None:
        for layer in layers:
            layer.use_parallel_residual = parallel

    _check_wrong_variant_shows(harness, llm, checkpoint, harness.prompts((20, 37), seed=21), other_form, restore)


@pytest.mark.parametrize("wrong", ["whole head", "interleaved"])
def test_wrong_rotary_would_show(stablelm_checkpoint, harness, wrong: str) -> None:
    checkpoint = stablelm_checkpoint(**CASES["stablelm2"])
    llm = harness.llm(checkpoint)
    attentions = [layer.self_attn for layer in _layers(llm)]
    right = [attention.rotary_emb for attention in attentions]
    config = llm.llm_engine.runner.model.config
    factor = 1.0 if wrong == "whole head" else 0.25
    rope = {**config.rope_parameters, "partial_rotary_factor": factor}
    replacement = get_rope(HEAD_DIM, config.max_position_embeddings, rope, interleaved=wrong == "interleaved")

    def swap(rotaries) -> None:
        for attention, rotary in zip(attentions, rotaries):
            attention.rotary_emb = rotary

    _check_wrong_variant_shows(harness, llm, checkpoint, harness.prompts((20, 37), seed=21),
                               lambda: swap([replacement] * len(attentions)), lambda: swap(right))


def test_chunked_prefill(stablelm_checkpoint, harness) -> None:
    checkpoint = stablelm_checkpoint(**CASES["stablelm2_12b"])
    prompts = harness.prompts((5, 40, 13, 29), seed=SEEDS["chunked"])
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


def test_chunked_prefill_logits(stablelm_checkpoint, harness) -> None:
    # chunks of 8 tokens: each chunk attends to K/V that earlier chunks left in the cache
    checkpoint = stablelm_checkpoint(**CASES["qk_norm_sequential_bias_v5"])
    llm = harness.llm(checkpoint, max_num_batched_tokens=8, block_size=8)
    diff = harness.max_logits_diff(llm, checkpoint.model, harness.prompts((45,), seed=17))
    assert llm.llm_engine.stats.prefill_chunks == 5
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


@pytest.mark.parametrize("name", ["stablelm2_12b", "stablelm2"])
def test_preemption(stablelm_checkpoint, harness, name: str) -> None:
    harness.check_preemption(stablelm_checkpoint(**CASES[name]), seed=SEEDS["preemption"])


@pytest.mark.parametrize("overrides", [CASES["stablelm2_12b"], {"qk_layernorm": True, "num_key_value_heads": 1}],
                         ids=["kv-head-per-rank", "kv-head-replicated"])
def test_two_ranks_give_transformers_tokens(stablelm_checkpoint, harness, overrides) -> None:
    """Tensor parallel over two CPU ranks (gloo): each rank normalises its own heads with their own weights (the
    single KV head of the second case on both ranks)."""
    from cvllm.testing.checkpoints import cvllm_greedy

    checkpoint = stablelm_checkpoint(**overrides)
    prompts = harness.prompts((9, 21), seed=4)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    assert cvllm_greedy(checkpoint.path, prompts, harness.NEW_TOKENS, dtype="float32", num_kv_blocks=32,
                        tensor_parallel_size=2) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_with_graphs_matches(case, harness) -> None:
    """On the CUDA backend with CUDA graphs (issue 20 item 6): LayerNorm, partial rotary, qkv bias, per-head q/k
    LayerNorm, parallel residual."""
    harness.check_cuda(case, harness.prompts((5, 11, 26, 40), seed=SEEDS["greedy"]))
