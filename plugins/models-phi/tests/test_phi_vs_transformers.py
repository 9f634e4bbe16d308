"""cvllm's Phi-2 against transformers 5.24 on tiny random checkpoints.

Prompt logits match within fp32 tolerance and greedy generations token for token, through the paged KV cache with
batching, chunked prefill and preemption. The comparison would catch the likely mistakes: a sequential residual
instead of the parallel one, full instead of partial rotary, exact instead of tanh GELU.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch

from cvllm.layers import get_rope

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES: dict[str, dict[str, Any]] = {
    "phi2": {},                                            # Phi-2's layout, config as published
    # transformers 5's spelling, GQA, qk_layernorm, tied embeddings (the head keeps its own bias)
    "phi2_qk_layernorm_v5": {"spelling": "v5", "num_key_value_heads": 2, "qk_layernorm": True,
                             "tie_word_embeddings": True},
}


@pytest.fixture(params=sorted(CASES))
def case(request, phi_checkpoint):
    return phi_checkpoint("phi", **CASES[request.param])


def test_prompt_logits_match(case, harness) -> None:
    prompts = harness.prompts((7, 23, 50), seed=11)
    diff = harness.max_logits_diff(harness.llm(case), case.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_greedy_matches_in_one_batch(case, harness) -> None:
    prompts = harness.prompts((5, 11, 26, 40), seed=118)
    want = harness.oracle_greedy(case.model, prompts)
    llm = harness.llm(case)
    assert harness.greedy(llm, prompts) == want
    # all prompts ran side by side: one at a time would take a step per generated token
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS


def test_chunked_prefill(phi_checkpoint, harness) -> None:
    checkpoint = phi_checkpoint("phi")
    prompts = harness.prompts((5, 40, 13, 29), seed=15)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


def test_preemption(phi_checkpoint, harness) -> None:
    harness.check_preemption(phi_checkpoint("phi"))


# ---- the comparison can fail ----


def sequential_residual(layer, positions, hidden, residual):
    """The GPT-2 order: the MLP reads the norm of (x + attention), not the same norm as attention."""
    if residual is not None:
        hidden = hidden + residual
    hidden = hidden + layer.self_attn(positions, layer.input_layernorm(hidden))
    return layer.mlp(layer.input_layernorm(hidden)), hidden


def test_wrong_variants_would_show(phi_checkpoint, harness) -> None:
    checkpoint = phi_checkpoint("phi")
    prompts = harness.prompts((30,), seed=12)
    llm = harness.llm(checkpoint)
    model = llm.llm_engine.runner.model
    layers = model.model.layers
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL
    assert layers[0].self_attn.rotary_emb.rotary_dim == 6   # int(16 * 0.4), as transformers truncates it

    def differs(times: float = 100) -> bool:
        return harness.max_logits_diff(llm, checkpoint.model, prompts) > times * harness.LOGITS_ATOL

    for layer in layers:
        layer.forward = types.MethodType(sequential_residual, layer)
    assert differs(), "sequential residual"
    for layer in layers:
        del layer.forward
        layer.mlp.approximate = "none"
    assert differs(10), "exact GELU"   # the two formulas differ by ~1e-3 at most: a smaller, still clear gap
    full_rope = get_rope(16, model.config.max_position_embeddings, {"rope_type": "default", "rope_theta": 10000.0})
    for layer in layers:
        layer.mlp.approximate = "tanh"
        layer.self_attn.rotary_emb = full_rope
    assert differs(), "full rotary"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_with_graphs_matches(case, harness) -> None:
    """On the CUDA backend with CUDA graphs (issue 20 item 6): Phi-2's parallel attention/MLP, LayerNorm with
    biases, partial rotary, GELU."""
    harness.check_cuda(case, harness.prompts((5, 11, 26, 40), seed=118))
