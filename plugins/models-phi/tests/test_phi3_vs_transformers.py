"""cvllm's Phi-3 against transformers 5.24 on tiny random checkpoints (LongRoPE: test_phi3_longrope.py).

Prompt logits match within fp32 tolerance and greedy generations token for token, through the paged KV cache with
batching, chunked prefill and preemption. The fused qkv_proj / gate_up_proj tensors load split into their shards,
partial rotary (Phi-4-mini) rotates the first dims of each head only, and a sliding window shorter than the
prompts applies on every layer; the tests show a window left out, or partial rotary ignored, would be caught.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from cvllm.layers import get_rope

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WINDOW = 8

CASES: dict[str, dict[str, Any]] = {
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},   # GQA, config as published
    # Phi-4-mini's shape: 3/4 of each head rotated, tied embeddings; transformers 5's spelling
    "phi4_mini_v5": {"spelling": "v5", "partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    "phi3_sliding": {"sliding_window": WINDOW},
}


@pytest.fixture(params=sorted(CASES))
def case(request, phi_checkpoint):
    return phi_checkpoint("phi3", **CASES[request.param])


def test_checkpoint_stores_fused_tensors(phi_checkpoint) -> None:
    from safetensors import safe_open

    checkpoint = phi_checkpoint("phi3", **CASES["phi3"])
    with safe_open(str(checkpoint.path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(part in name for name in names for part in (".q_proj.", ".gate_proj."))


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
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS


def test_chunked_prefill(phi_checkpoint, harness) -> None:
    checkpoint = phi_checkpoint("phi3", **CASES["phi3"])
    prompts = harness.prompts((5, 40, 13, 29), seed=15)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


@pytest.mark.parametrize(("name", "seed"), [("phi3", 16), ("phi3_sliding", 26)])   # seeds with no near-tie
def test_preemption(phi_checkpoint, harness, name: str, seed: int) -> None:
    harness.check_preemption(phi_checkpoint("phi3", **CASES[name]), seed=seed)


# ---- sliding window ----


def test_sliding_window_on_every_layer(phi_checkpoint, harness) -> None:
    checkpoint = phi_checkpoint("phi3", **CASES["phi3_sliding"])
    assert json.loads((checkpoint.path / "config.json").read_text())["sliding_window"] == WINDOW
    prompts = harness.prompts((20, 37), seed=21)
    llm = harness.llm(checkpoint)
    layers = llm.llm_engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW] * len(layers)
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL
    for layer in layers:   # the comparison would catch the window left out
        layer.self_attn.attn.sliding_window = None
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) > 100 * harness.LOGITS_ATOL


def test_chunked_prefill_logits_with_sliding_window(phi_checkpoint, harness) -> None:
    # chunks of 8 tokens: each chunk attends to K/V that earlier chunks left in the cache, through the window
    checkpoint = phi_checkpoint("phi3", **CASES["phi3_sliding"])
    llm = harness.llm(checkpoint, max_num_batched_tokens=8, block_size=8)
    diff = harness.max_logits_diff(llm, checkpoint.model, harness.prompts((45,), seed=17))
    assert llm.llm_engine.stats.prefill_chunks == 5
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_partial_rotary_would_show(phi_checkpoint, harness) -> None:
    checkpoint = phi_checkpoint("phi3", **CASES["phi4_mini_v5"])
    llm = harness.llm(checkpoint)
    layers = llm.llm_engine.runner.model.model.layers
    assert layers[0].self_attn.rotary_emb.rotary_dim == 12
    prompts = harness.prompts((30,), seed=12)
    full = get_rope(16, 256, {"rope_type": "default", "rope_theta": 10000.0})
    for layer in layers:
        layer.self_attn.rotary_emb = full
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) > 100 * harness.LOGITS_ATOL


def test_tensor_parallel_splits_the_fused_tensors(phi_checkpoint, harness) -> None:
    # two CPU ranks: each reads its rows of the q, k, v and gate, up blocks of the fused checkpoint tensors
    from cvllm.testing import cvllm_greedy

    checkpoint = phi_checkpoint("phi3", **CASES["phi3"])
    prompts = harness.prompts((5, 14), seed=19)
    want = harness.oracle_greedy(checkpoint.model, prompts, 8)
    assert cvllm_greedy(checkpoint.path, prompts, 8, dtype="float32", tensor_parallel_size=2) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_with_graphs_matches(case, harness) -> None:
    """On the CUDA backend with CUDA graphs (issue 20 item 6): fused qkv/gate_up, partial rotary, sliding
    window."""
    harness.check_cuda(case, harness.prompts((5, 11, 26, 40), seed=118))
