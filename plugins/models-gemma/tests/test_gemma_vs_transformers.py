"""cvllm's Gemma, Gemma 2 and Gemma 3 against transformers 5.24 on tiny random checkpoints.

Prompt logits match within fp32 tolerance and greedy generations token for token, through the paged KV cache
with batching, chunked prefill and preemption, with sliding windows shorter than the prompts and soft-caps that
bite. The "details matter" tests undo one Gemma detail at a time in the loaded model (the (1 + w) norms, the
embedding scale, the soft-caps, the softmax scale, the local/global split and ropes) and show each would be caught.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from cvllm_gemma.layers import GemmaRMSNorm
from cvllm_gemma.testing import ATTN_SOFT_CAP, FINAL_SOFT_CAP, WINDOW

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# global layers with linear rope scaling, local ones with a base of their own: both differ from the defaults
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # config.json as gemma-7b's: hidden_act "gelu" meaning the tanh GELU
    "gemma": ("gemma", {"spelling": "published"}),
    # gemma-2b's multi-query attention, an untied LM head
    "gemma_mqa_untied_v5": ("gemma", {"spelling": "v5", "num_key_value_heads": 1, "tie_word_embeddings": False}),
    # no layer_types: the rule decides (sliding, global, sliding); a softmax scale from query_pre_attn_scalar
    "gemma2": ("gemma2", {"spelling": "published", "query_pre_attn_scalar": 32}),
    # layer_types as transformers 5 writes them, here not the rule's
    "gemma2_v5": ("gemma2", {"spelling": "v5", "layer_types": ["full_attention", "sliding_attention",
                                                                "sliding_attention"]}),
    # an attention soft-cap in the config, which transformers 5.24's Gemma 3 never applies (null when published)
    "gemma3_v5": ("gemma3", {"spelling": "v5", "final_logit_softcapping": FINAL_SOFT_CAP,
                             "attn_logit_softcapping": ATTN_SOFT_CAP}),
    # rope_theta / rope_local_base_freq / rope_scaling, sliding_window_pattern (no layer_types)
    "gemma3": ("gemma3", {"spelling": "published", "rope_parameters": GEMMA3_ROPE, "query_pre_attn_scalar": 24}),
    # the multimodal checkpoints: tensors as saved (language_model.model.*), the hub's sparse text_config ...
    "gemma3_multimodal": ("gemma3_multimodal", {"rope_parameters": GEMMA3_ROPE}),
    # ... and as transformers 5 holds them (model.language_model.*), its full text_config
    "gemma3_multimodal_v5": ("gemma3_multimodal", {"layout": "v5", "spelling": "v5"}),
}
# each case's layers' windows, as transformers' model has them
WINDOWS = {"gemma2": [WINDOW, None, WINDOW], "gemma2_v5": [None, WINDOW, WINDOW], "gemma3": [WINDOW, None, WINDOW]}


def _checkpoint(gemma_checkpoint, name: str):
    arch, kwargs = CASES[name]
    return gemma_checkpoint(arch, **kwargs)


@pytest.fixture(params=sorted(CASES))
def case(request, gemma_checkpoint):
    return _checkpoint(gemma_checkpoint, request.param)


def test_prompt_logits_match(case, harness) -> None:
    prompts = harness.prompts((7, 23, 50), seed=11)
    diff = harness.max_logits_diff(harness.llm(case), case.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_greedy_matches_in_one_batch(case, harness) -> None:
    # 11, 26 and 40 are longer than the window and span several KV blocks
    prompts = harness.prompts((5, 11, 26, 40), seed=4)  # every oracle far from a near-tie
    want = harness.oracle_greedy(case.model, prompts)
    llm = harness.llm(case)
    assert harness.greedy(llm, prompts) == want
    # all prompts ran side by side: one at a time would take a step per generated token
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS


@pytest.mark.parametrize("name", sorted(WINDOWS))
def test_layer_windows_as_transformers(gemma_checkpoint, harness, name: str) -> None:
    checkpoint = _checkpoint(gemma_checkpoint, name)
    text_config = checkpoint.model.config
    assert [WINDOW if t == "sliding_attention" else None for t in text_config.layer_types] == WINDOWS[name]
    layers = harness.llm(checkpoint).llm_engine.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == WINDOWS[name]


# ---- engine mechanisms ----


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_chunked_prefill_logits_through_windows(gemma_checkpoint, harness, name: str) -> None:
    # chunks of 8 tokens: each chunk attends to K/V that earlier chunks left in the cache, through the window
    checkpoint = _checkpoint(gemma_checkpoint, name)
    llm = harness.llm(checkpoint, max_num_batched_tokens=8, block_size=8)
    diff = harness.max_logits_diff(llm, checkpoint.model, harness.prompts((45,), seed=17))
    assert llm.llm_engine.stats.prefill_chunks == 5
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_chunked_prefill_greedy(gemma_checkpoint, harness) -> None:
    checkpoint = _checkpoint(gemma_checkpoint, "gemma2")
    prompts = harness.prompts((5, 40, 13, 29), seed=15)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


@pytest.mark.parametrize("name", ["gemma2", "gemma3_multimodal"])
def test_preemption(gemma_checkpoint, harness, name: str) -> None:
    harness.check_preemption(_checkpoint(gemma_checkpoint, name))


# ---- each Gemma detail is one the comparison would catch ----


@contextmanager
def changed(*edits: tuple[object, str, object]) -> Iterator[None]:
    """Set ``obj.attr = value`` for each edit, restore afterwards."""
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in edits]
    try:
        for obj, attr, value in edits:
            setattr(obj, attr, value)
        yield
    finally:
        for obj, attr, value in saved:
            setattr(obj, attr, value)


@contextmanager
def plain_weight_norms(model, where: str = "") -> Iterator[None]:
    """The (1 + w) RMSNorms computed as x * w (Llama's): the same as (1 + (w - 1))."""
    norms = [m for name, m in model.named_modules() if isinstance(m, GemmaRMSNorm) and where in name]
    assert norms
    for norm in norms:
        norm.weight.data -= 1.0
    try:
        yield
    finally:
        for norm in norms:
            norm.weight.data += 1.0


def _assert_caught(llm, checkpoint, harness, prompts, what: str) -> None:
    """The logits test would fail, by an order of magnitude over its tolerance (exact GELU for tanh: 3e-3)."""
    diff = harness.max_logits_diff(llm, checkpoint.model, prompts)
    assert diff > 10 * harness.LOGITS_ATOL, f"{what}: max |diff| only {diff:.2e}"


def test_gemma_details_matter(gemma_checkpoint, harness) -> None:
    checkpoint = _checkpoint(gemma_checkpoint, "gemma")
    llm, prompts = harness.llm(checkpoint), harness.prompts((30,), seed=23)
    model = llm.llm_engine.runner.model
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) < harness.LOGITS_ATOL
    with plain_weight_norms(model):
        _assert_caught(llm, checkpoint, harness, prompts, "x * w norms")
    with changed((model.model.embed_tokens, "scale", 1.0)):
        _assert_caught(llm, checkpoint, harness, prompts, "unscaled embedding")
    with changed(*((layer.mlp.act_fn, "approximate", "none") for layer in model.model.layers)):
        _assert_caught(llm, checkpoint, harness, prompts, "exact GELU")


def test_gemma2_details_matter(gemma_checkpoint, harness) -> None:
    checkpoint = _checkpoint(gemma_checkpoint, "gemma2")
    llm, prompts = harness.llm(checkpoint), harness.prompts((30,), seed=24)
    model = llm.llm_engine.runner.model
    attns = [layer.self_attn.attn for layer in model.model.layers]
    assert [a.logits_soft_cap for a in attns] == [ATTN_SOFT_CAP] * 3
    assert model.final_logit_softcapping == FINAL_SOFT_CAP
    with changed(*((a, "logits_soft_cap", None) for a in attns)):
        _assert_caught(llm, checkpoint, harness, prompts, "no attention soft-cap")
    with changed((model, "final_logit_softcapping", None)):
        _assert_caught(llm, checkpoint, harness, prompts, "no final soft-cap")
    with changed(*((a, "scale", a.head_dim**-0.5) for a in attns)):
        _assert_caught(llm, checkpoint, harness, prompts, "head_dim ** -0.5 as the scale")
    for windows in ([WINDOW] * 3, [None] * 3, [None, WINDOW, None]):
        with changed(*((a, "sliding_window", w) for a, w in zip(attns, windows))):
            _assert_caught(llm, checkpoint, harness, prompts, f"windows {windows}")
    with plain_weight_norms(model, "feedforward_layernorm"):
        _assert_caught(llm, checkpoint, harness, prompts, "x * w feed-forward norms")


def test_gemma3_details_matter(gemma_checkpoint, harness) -> None:
    checkpoint = _checkpoint(gemma_checkpoint, "gemma3")
    llm, prompts = harness.llm(checkpoint), harness.prompts((30,), seed=25)
    model = llm.llm_engine.runner.model
    attentions = [layer.self_attn for layer in model.model.layers]
    local, global_ = attentions[0].rotary_emb, attentions[1].rotary_emb
    with changed(*((a, "rotary_emb", global_) for a in attentions)):
        _assert_caught(llm, checkpoint, harness, prompts, "the global rope everywhere")
    with changed(*((a, "rotary_emb", local) for a in attentions)):
        _assert_caught(llm, checkpoint, harness, prompts, "the local rope everywhere")
    with plain_weight_norms(model, "_norm"):  # q_norm and k_norm only
        _assert_caught(llm, checkpoint, harness, prompts, "x * w q/k norms")
    with changed(*((a.attn, "scale", a.attn.head_dim**-0.5) for a in attentions)):
        _assert_caught(llm, checkpoint, harness, prompts, "head_dim ** -0.5 as the scale")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_with_graphs_matches(case, harness) -> None:
    """On the CUDA backend with CUDA graphs (issue 20 item 6): (1 + w) RMSNorms, soft-capping, alternating
    sliding windows, Gemma 3's q/k norms and local/global bases."""
    harness.check_cuda(case, harness.prompts((5, 11, 26, 40), seed=4))
