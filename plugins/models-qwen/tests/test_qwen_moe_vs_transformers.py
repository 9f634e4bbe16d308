"""cvllm's Qwen2-MoE and Qwen3-MoE against transformers 5.24 on tiny random checkpoints (8 experts, top-2).

Logits match within fp32 tolerance and greedy generations token for token, with batching, chunked prefill and
preemption; the experts load from every checkpoint form (per-expert tensors as save_pretrained writes them,
transformers' fused gate_up_proj, GGUF-style stacked tensors); the routing really spreads tokens over experts,
and getting norm_topk_prob wrong would show.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cvllm.layers import FusedMoE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    # shared expert, norm_topk_prob False (the default), every layer MoE
    "qwen2_moe": ("qwen2_moe", {}),
    # layer 1 of 3 a dense MLP through mlp_only_layers; tied embeddings; sharded; transformers 5's config
    "qwen2_moe_v5": ("qwen2_moe", {"spelling": "v5", "shards": 2, "num_hidden_layers": 3, "mlp_only_layers": [1],
                                   "tie_word_embeddings": True}),
    # every second layer MoE (decoder_sparse_step 2), except layer 3 (mlp_only_layers): only layer 1 is MoE
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True, "decoder_sparse_step": 2, "mlp_only_layers": [3],
                                "num_hidden_layers": 4}),
    # experts saved in transformers' in-memory form (experts.gate_up_proj), num_local_experts in config.json
    "qwen3_moe_fused_v5": ("qwen3_moe", {"spelling": "v5", "fused_experts": True, "norm_topk_prob": True}),
}
MOE_LAYERS = {"qwen2_moe": [0, 1], "qwen2_moe_v5": [0, 2], "qwen3_moe": [1], "qwen3_moe_fused_v5": [0, 1]}


def _checkpoint(qwen_checkpoint, name: str):
    arch, kwargs = CASES[name]
    return qwen_checkpoint(arch, **kwargs)


@pytest.fixture(params=sorted(CASES))
def case(request, qwen_checkpoint):
    return request.param, _checkpoint(qwen_checkpoint, request.param)


def moe_layers(llm) -> dict[int, FusedMoE]:
    layers = llm.llm_engine.runner.model.model.layers
    return {i: layer.mlp.experts for i, layer in enumerate(layers) if isinstance(getattr(layer.mlp, "experts", None),
                                                                                   FusedMoE)}


def test_moe_layers_and_routing_follow_the_config(case, harness) -> None:
    name, checkpoint = case
    config = checkpoint.model.config
    hf_sparse = [i for i, layer in enumerate(checkpoint.model.model.layers) if hasattr(layer.mlp, "experts")]
    assert hf_sparse == MOE_LAYERS[name]
    experts = moe_layers(harness.llm(checkpoint))
    assert sorted(experts) == MOE_LAYERS[name]
    for layer in experts.values():
        assert (layer.num_experts, layer.top_k, layer.routing.renormalize) == (8, 2, config.norm_topk_prob)


def test_prompt_logits_match_and_use_several_experts(case, harness) -> None:
    _, checkpoint = case
    prompts = harness.prompts((7, 23, 50), seed=11)
    llm = harness.llm(checkpoint)
    experts = moe_layers(llm)
    for layer in experts.values():
        layer.enable_expert_counts()
    diff = harness.max_logits_diff(llm, checkpoint.model, prompts)
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"
    for index, layer in experts.items():
        counts = layer.expert_counts.tolist()
        assert sum(counts) == 2 * sum(map(len, prompts))  # every token went to exactly top_k experts
        assert sum(c > 0 for c in counts) >= 4, f"layer {index} routed everything to a few experts: {counts}"


def test_greedy_matches_in_one_batch(case, harness) -> None:
    _, checkpoint = case
    prompts = harness.prompts((5, 11, 26, 40), seed=118)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint)
    assert harness.greedy(llm, prompts) == want
    assert llm.llm_engine.stats.steps < len(prompts) * harness.NEW_TOKENS  # the prompts ran side by side


@pytest.mark.parametrize("name", ["qwen2_moe", "qwen3_moe"])
def test_wrong_renormalisation_would_show(qwen_checkpoint, harness, name: str) -> None:
    checkpoint = _checkpoint(qwen_checkpoint, name)
    llm = harness.llm(checkpoint)
    prompts = harness.prompts((30,), seed=12)
    for layer in moe_layers(llm).values():
        layer.routing = dataclasses.replace(layer.routing, renormalize=not layer.routing.renormalize)
    assert harness.max_logits_diff(llm, checkpoint.model, prompts) > 100 * harness.LOGITS_ATOL


def _stacked_copy(source: Path, dest: Path) -> None:
    """The checkpoint with each layer's experts stacked into [E, out, in] tensors, as GGUF files hold them."""
    tensors = load_file(source / "model.safetensors")
    per_expert = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
    stacked: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out = {}
    for name, tensor in tensors.items():
        match = per_expert.fullmatch(name)
        if match:
            stacked.setdefault((match[1], match[3]), {})[int(match[2])] = tensor
        else:
            out[name] = tensor
    assert stacked
    for (module, proj), experts in stacked.items():
        out[f"{module}.{proj}.weight"] = torch.stack([experts[e] for e in sorted(experts)])
    dest.mkdir()
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    for path in source.glob("*.json"):
        shutil.copy(path, dest / path.name)


def test_stacked_expert_tensors_load(qwen_checkpoint, harness, tmp_path: Path) -> None:
    checkpoint = _checkpoint(qwen_checkpoint, "qwen3_moe")
    stacked = type(checkpoint)(tmp_path / "stacked", checkpoint.model)
    _stacked_copy(checkpoint.path, stacked.path)
    assert any(".experts.gate_proj." in n for n in load_file(stacked.path / "model.safetensors"))
    diff = harness.max_logits_diff(harness.llm(stacked), checkpoint.model, harness.prompts((7, 30), seed=13))
    assert diff < harness.LOGITS_ATOL, f"max |diff| {diff:.2e}"


def test_config_spelling(qwen_checkpoint) -> None:
    # the fused case must exercise num_local_experts, the published one num_experts
    fused = json.loads((_checkpoint(qwen_checkpoint, "qwen3_moe_fused_v5").path / "config.json").read_text())
    published = json.loads((_checkpoint(qwen_checkpoint, "qwen3_moe").path / "config.json").read_text())
    assert "num_local_experts" in fused and "num_experts" not in fused
    assert "num_experts" in published and "num_local_experts" not in published


# ---- engine mechanisms ----


def test_chunked_prefill(qwen_checkpoint, harness) -> None:
    checkpoint = _checkpoint(qwen_checkpoint, "qwen2_moe")
    prompts = harness.prompts((5, 40, 13, 29), seed=15)
    want = harness.oracle_greedy(checkpoint.model, prompts)
    llm = harness.llm(checkpoint, max_num_batched_tokens=16)
    assert harness.greedy(llm, prompts) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


def test_preemption(qwen_checkpoint, harness) -> None:
    harness.check_preemption(_checkpoint(qwen_checkpoint, "qwen3_moe"))
