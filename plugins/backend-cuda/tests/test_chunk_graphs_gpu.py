"""A lone sequence's short prefill chunks replayed from CUDA graphs (cvllm_cuda/graphs.py): a short prompt, and what
the prefix cache leaves of a repeated one, give the logits and tokens of the eager forward; the graph's spare rows
write no KV and reach no output; an FP8 cache's scales still come from the first real prefill. GPU only."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import greedy_margins, hf_greedy, make_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NEW_TOKENS = 16
# one at a time: each prompt's prefill is a lone chunk; 5 -> the graph of 8, 11 -> 16, 26 -> 32, 40 -> 64, 64 itself
LENGTHS = (5, 11, 26, 40, 64)


def prompts(seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in LENGTHS]


def one_at_a_time(llm: LLM, token_lists: list[list[int]], **params) -> list:
    params = SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **params})
    return [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0] for p in token_lists]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, make_checkpoint(path, "llama")


def make_llm(path, **options) -> LLM:
    return LLM(str(path), backend="cuda", **{"dtype": "float32", "max_num_seqs": 4, "block_size": 16, **options})


def test_lone_prompts_replay_chunk_graphs_and_match_transformers(llama):
    path, model = llama
    token_lists = prompts()
    want = hf_greedy(model, token_lists, NEW_TOKENS)
    for prompt, output in zip(token_lists, want):
        assert min(greedy_margins(model, prompt, output)) > 1e-3, "oracle near-tie: pick another seed"
    llm = make_llm(path)
    graphs = llm.llm_engine.runner.decode_forward
    assert graphs.chunk_sizes == [8, 16, 32, 64]
    got = [list(out.token_ids) for out in one_at_a_time(llm, token_lists)]
    assert got == want
    assert graphs.chunk_replays == len(LENGTHS)
    # the same prompts again: the prefix cache holds their full blocks, the rest (1-15 tokens) replays a graph
    again = [list(out.token_ids) for out in one_at_a_time(llm, token_lists)]
    assert again == want and graphs.chunk_replays == 2 * len(LENGTHS)
    assert llm.llm_engine.stats.prefix_hit_tokens > 0


def test_chunk_graph_logprobs_equal_eager(llama):
    """The first token's top logprobs (the chunk's last row) from the graph and from the eager forward."""
    path, _ = llama
    token_lists = prompts(seed=9)

    def first_logprobs(**options):
        outs = one_at_a_time(make_llm(path, **options), token_lists, max_tokens=1, logprobs=5)
        return [{t: lp.logprob for t, lp in out.logprobs[0].items()} for out in outs]

    graphs, eager = first_logprobs(), first_logprobs(enforce_eager=True)
    for g, e in zip(graphs, eager):
        assert g.keys() == e.keys()
        assert max(abs(g[t] - e[t]) for t in g) < 1e-4


def test_spare_rows_write_no_kv_and_reach_no_output(llama):
    """A cache full of NaN: the padded rows of a chunk graph (and the graphs' placeholder runs) must not read
    into a real row or write over a real slot."""
    path, _ = llama
    token_lists = prompts(seed=21)

    def run(fill: float) -> list[list[int]]:
        llm = make_llm(path, dtype="bfloat16")
        for layer in llm.llm_engine.runner.attention_layers:
            layer.k_cache.fill_(fill)
            layer.v_cache.fill_(fill)
        tokens = [list(out.token_ids) for out in one_at_a_time(llm, token_lists + token_lists)]
        assert llm.llm_engine.runner.decode_forward.chunk_replays == 2 * len(LENGTHS)
        return tokens

    assert run(float("nan")) == run(0.0)


def test_fp8_cache_scales_come_from_the_first_prefill_not_a_capture(llama):
    """With FP8 KV (scales set by the first prefill) and verify graphs, the graphs' capture runs on placeholder
    inputs must not set the scales: they are those of the eager engine, whose first prefill set them."""
    path, _ = llama
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    token_lists = prompts(seed=5)

    def scales(**options):
        llm = make_llm(path, dtype="bfloat16", kv_cache_dtype="fp8", speculative_config=spec, **options)
        layer = llm.llm_engine.runner.attention_layers[0]
        assert layer.kv_scales_pending, "a capture set the FP8 scales"
        outs = one_at_a_time(llm, token_lists)
        return [list(o.token_ids) for o in outs], layer.k_scale.clone(), llm.llm_engine.runner.decode_forward

    tokens, k_scale, graphs = scales()
    eager_tokens, eager_k_scale, _ = scales(enforce_eager=True)
    torch.testing.assert_close(k_scale, eager_k_scale, rtol=0, atol=0)
    # the first prompt calibrated eagerly; the others' prefills replayed chunk graphs
    assert graphs.chunk_replays == len(LENGTHS) - 1
    assert tokens[0] == eager_tokens[0]
