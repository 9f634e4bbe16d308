"""cvllm's DeepSeek-V2 and V3 against transformers 5.24 on tiny random checkpoints: multi-head latent attention
over the latent cache (q_lora and not, interleaved and neox rope, YaRN with mscale), grouped routing (V2's
group-limited greedy, V3's noaux_tc with its correction bias), shared experts, a first dense layer. Logits within
fp32 tolerance, greedy tokens equal through batching, chunked prefill, prefix caching and preemption; the cache
holds the latent only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.layers import FusedMoE
from cvllm.testing import greedy_margins, hf_greedy, hf_logits
from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE

YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 64,
                            "beta_fast": 32, "beta_slow": 1}}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v2-lite": ("deepseek_v2", {}),                          # no q_lora, group-limited greedy
    "v2-greedy": ("deepseek_v2", {"topk_method": "greedy", "q_lora_rank": 24}),
    "v3": ("deepseek_v3", {}),                               # q_lora, noaux_tc, interleaved rope
    "v3-neox-yarn": ("deepseek_v3", {"rope_interleave": False, **YARN, "tie_word_embeddings": True}),
}
ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
          "enable_prefix_caching": True}
# relative to the logits' size: the absorbed attention multiplies in another order than transformers' decompressed
# K and V (W_UK^T q . c against q . W_UK c), so fp32 rounding differs more than between two plain attentions
LOGITS_RTOL = 2e-5
NEW_TOKENS = 12


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]


def oracle(model, batch: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens, far enough from a tie to be a fair reference."""
    outputs = hf_greedy(model, batch, NEW_TOKENS)
    for prompt, output in zip(batch, outputs):
        assert min(greedy_margins(model, prompt, output)) > 1e-3, "oracle near-tie: pick other prompts"
    return outputs


def greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]


@pytest.fixture(params=sorted(CASES))
def case(request, deepseek_checkpoint):
    arch, overrides = CASES[request.param]
    return request.param, *deepseek_checkpoint(arch, **overrides)


def test_prompt_logits_match_and_routing_spreads(case) -> None:
    name, path, model = case
    llm = LLM(model=str(path), **ENGINE)
    experts = [layer.mlp.experts for layer in llm.llm_engine.runner.model.model.layers
               if isinstance(getattr(layer.mlp, "experts", None), FusedMoE)]
    assert len(experts) == 2   # layer 0 dense (first_k_dense_replace)
    for layer in experts:
        layer.enable_expert_counts()
    batch = prompts((7, 23, 50), seed=11)
    for got, prompt in zip(llm.llm_engine.prompt_logits(batch), batch):
        want = hf_logits(model, prompt)
        diff = (got.float().cpu() - want).abs().max().item()
        assert diff < LOGITS_RTOL * want.abs().max().item(), f"{name}: max |diff| {diff:.2e} of {want.abs().max():.1f}"
    for layer in experts:
        counts = layer.expert_counts.tolist()
        assert sum(counts) == 2 * sum(map(len, batch)) and sum(c > 0 for c in counts) >= 4, counts


def test_greedy_in_one_batch_with_chunked_prefill_and_prefix_caching(case) -> None:
    _, path, model = case
    batch = prompts((5, 11, 26, 40), seed=100)
    want = oracle(model, batch)
    assert greedy(LLM(model=str(path), **ENGINE), batch) == want
    # prefill in chunks of 16 tokens; the second prompt repeats the first's 32-token prefix (cached blocks)
    shared = prompts((45,), seed=3)[0]
    batch = [shared, shared[:32] + prompts((9,), seed=103)[0]]
    llm = LLM(model=str(path), **{**ENGINE, "max_num_batched_tokens": 16, "max_num_seqs": 2})
    assert greedy(llm, batch[:1]) + greedy(llm, batch[1:]) == oracle(model, batch)


def test_preemption_recomputes_the_latent(deepseek_checkpoint) -> None:
    path, model = deepseek_checkpoint("deepseek_v3")
    batch = prompts((40, 38, 36, 34), seed=16)
    blocks = [-(-(len(p) + NEW_TOKENS) // 16) for p in batch]
    llm = LLM(model=str(path), **{**ENGINE, "num_kv_blocks": max(blocks) + 2})
    assert sum(blocks) > max(blocks) + 2
    assert greedy(llm, batch) == oracle(model, batch)
    assert llm.llm_engine.stats.preemptions > 0


def test_the_cache_holds_the_latent_only(deepseek_checkpoint) -> None:
    """kv_lora_rank + qk_rope_head_dim values per token and layer (32 + 8 here; DeepSeek-V3: 576), one tensor:
    V is K's cache."""
    path, _ = deepseek_checkpoint("deepseek_v3")
    llm = LLM(model=str(path), **{**ENGINE, "num_kv_blocks": 8})
    runner = llm.llm_engine.runner
    assert runner.kv_bytes_per_block() == 3 * (32 + 8) * 16 * 4
    for layer in runner.attention_layers:
        assert layer.k_cache is layer.v_cache and layer.k_cache.shape == (8, 16, 1, 40)


def test_dropping_the_correction_bias_would_show(deepseek_checkpoint) -> None:
    path, model = deepseek_checkpoint("deepseek_v3")
    llm = LLM(model=str(path), **ENGINE)
    for layer in llm.llm_engine.runner.model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    prompt = prompts((30,), seed=12)[0]
    got, want = llm.llm_engine.prompt_logits([prompt])[0], hf_logits(model, prompt)
    assert (got.float().cpu() - want).abs().max().item() > 100 * LOGITS_RTOL * want.abs().max().item()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_give_one_ranks_tokens(deepseek_checkpoint, expert_parallel) -> None:
    """Tensor parallel over two CPU ranks (gloo): heads split (q_b, kv_b by head, o_proj by row), the latent
    and the router replicated; experts sharded within each expert or, with expert parallelism, split whole."""
    from cvllm.testing.checkpoints import cvllm_greedy

    path, _ = deepseek_checkpoint("deepseek_v3")
    batch = prompts((9, 21), seed=4)
    options = dict(dtype="float32", num_kv_blocks=32)
    one = cvllm_greedy(path, batch, 8, **options)
    assert cvllm_greedy(path, batch, 8, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
                        **options) == one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_cuda_gives_transformers_tokens(deepseek_checkpoint, arch) -> None:
    """On CUDA under graphs: the MLA kernel (rope 16: its smallest part) and the fused MoE."""
    path, model = deepseek_checkpoint(arch, qk_rope_head_dim=16)
    llm = LLM(model=str(path), backend="cuda", **ENGINE)
    try:
        layer = llm.llm_engine.runner.attention_layers[0]
        assert layer.shared_kv and (layer.head_dim, layer.value_dim) == (48, 32)
        batch = prompts((5, 11, 26, 40), seed=100)
        assert greedy(llm, batch) == oracle(model, batch)
    finally:
        llm.shutdown()


def test_isq_quantizes_the_projections_not_the_router(deepseek_checkpoint) -> None:
    path, model = deepseek_checkpoint("deepseek_v3")
    llm = LLM(model=str(path), isq="q8_0", **{**ENGINE, "num_kv_blocks": 16})
    moe = llm.llm_engine.runner.model.model.layers[1].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.weight.shape == (8, 64)
    want_bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    torch.testing.assert_close(moe.gate.e_score_correction_bias.cpu(), want_bias)
    assert llm.llm_engine.runner.model.model.layers[1].self_attn.o_proj.quant_method is not None
    assert len(greedy(llm, prompts((9,), seed=1))[0]) == NEW_TOKENS
