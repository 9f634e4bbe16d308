"""cvllm's Llama and Mistral against transformers on tiny random checkpoints.

Logits match within fp32 tolerance, greedy generations match token for token, through the paged KV
cache with batching, chunked prefill, preemption and prefix caching; each mechanism test also
checks from the engine's counters that the mechanism really ran.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.testing import EOS_TOKEN_ID, VARIANTS, greedy_margins, hf_greedy, hf_logits

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LOGITS_ATOL = 1e-4
# The oracle's top-1 must beat its top-2 by this much at every greedy step; below it, fp32 rounding
# differences between two correct implementations could pick the other token.
MIN_GREEDY_MARGIN = 1e-3
NEW_TOKENS = 24
# Prompt seeds are chosen so that every oracle margin is at least twice MIN_GREEDY_MARGIN.
GREEDY_SEED = 118

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": 16,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 2048,
    "max_model_len": None,
    "num_kv_blocks": None,
    "enable_prefix_caching": True,
}


@dataclass(frozen=True, slots=True)
class Case:
    arch: str
    variant: str
    spelling: str
    shards: int = 1
    rope_theta: float | None = None  # a non-default base, so a loader that ignores it fails

    def overrides(self) -> dict[str, Any]:
        overrides = dict(VARIANTS[self.variant])
        if self.rope_theta is not None:
            overrides["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
        return overrides


# Both config spellings, sharded and single-file checkpoints, spread over the variants.
CASES = {
    "gqa": Case("llama", "gqa", "published"),
    "mha": Case("llama", "mha", "v5", rope_theta=500000.0),
    "tied": Case("llama", "tied", "published", rope_theta=1000000.0),
    "bias": Case("llama", "bias", "v5", shards=2),
    "llama3_rope": Case("llama", "llama3_rope", "published"),
    "llama3_rope_v5": Case("llama", "llama3_rope", "v5"),
    "head_dim": Case("llama", "head_dim", "v5", shards=3),
    "sliding": Case("mistral", "sliding", "published"),
    "sliding_v5": Case("mistral", "sliding", "v5", shards=2, rope_theta=1000000.0),
}


def _checkpoint(tiny_checkpoint, name: str):
    case = CASES[name]
    return tiny_checkpoint(case.arch, spelling=case.spelling, shards=case.shards, **case.overrides())


@pytest.fixture(params=sorted(CASES))
def case_checkpoint(request, tiny_checkpoint):
    return _checkpoint(tiny_checkpoint, request.param)


@pytest.fixture
def gqa(tiny_checkpoint):
    return _checkpoint(tiny_checkpoint, "gqa")


@pytest.fixture
def tied(tiny_checkpoint):
    """The tied model reaches EOS on some of the EOS test's prompts."""
    return _checkpoint(tiny_checkpoint, "tied")


def random_prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    """Random non-special token ids (0..2 are the special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def oracle_greedy(model, prompts: list[list[int]], max_new_tokens: int, **kwargs: Any) -> list[list[int]]:
    """transformers' greedy tokens, checked to be far enough from a tie to be a fair reference."""
    outputs = hf_greedy(model, prompts, max_new_tokens, **kwargs)
    for i, (prompt, output) in enumerate(zip(prompts, outputs)):
        margin = min(greedy_margins(model, prompt, output))
        assert margin > MIN_GREEDY_MARGIN, f"oracle near-tie on prompt {i} (margin {margin:.2e}): pick others"
    return outputs


def make_llm(checkpoint, **overrides: Any) -> LLM:
    return LLM(model=str(checkpoint.path), **{**ENGINE_DEFAULTS, **overrides})


def generate(llm: LLM, prompts: list[list[int]], **sampling: Any):
    params = SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **sampling})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def token_ids(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


# ---- every variant ----


def test_prompt_logits_match(case_checkpoint) -> None:
    prompts = random_prompts((7, 23, 50), seed=11)
    llm = make_llm(case_checkpoint)
    got = llm.llm_engine.prompt_logits(prompts)
    assert len(got) == len(prompts)
    for prompt, logits in zip(prompts, got):
        want = hf_logits(case_checkpoint.model, prompt)
        assert tuple(logits.shape) == tuple(want.shape)
        diff = (logits.float().cpu() - want).abs().max().item()
        assert diff < LOGITS_ATOL, f"prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"


def test_greedy_matches(case_checkpoint) -> None:
    # 17, 26 and 40 are longer than the sliding window (16) and span several KV blocks.
    prompts = random_prompts((5, 11, 17, 26, 40), seed=GREEDY_SEED)
    want = oracle_greedy(case_checkpoint.model, prompts, NEW_TOKENS)
    outputs = generate(make_llm(case_checkpoint), prompts)
    assert token_ids(outputs) == want
    assert [out.outputs[0].finish_reason for out in outputs] == ["length"] * len(prompts)


# ---- engine mechanisms, on the GQA model ----


@pytest.mark.parametrize("block_size", [8, 16])
def test_prompts_spanning_several_blocks(gqa, block_size: int) -> None:
    # 16, 32 and 64 end exactly on a block boundary: the first decode step opens a new block.
    prompts = random_prompts((16, 32, 47, 64), seed=13)
    assert all(len(p) + NEW_TOKENS > 2 * block_size for p in prompts)  # each sequence fills 3+ blocks
    want = oracle_greedy(gqa.model, prompts, NEW_TOKENS)
    assert token_ids(generate(make_llm(gqa, block_size=block_size), prompts)) == want


def test_chunked_prefill(gqa) -> None:
    budget = 16
    prompts = random_prompts((5, 40, 13, 29), seed=15)
    assert max(map(len, prompts)) > budget
    want = oracle_greedy(gqa.model, prompts, NEW_TOKENS)
    llm = make_llm(gqa, max_num_batched_tokens=budget)
    assert token_ids(generate(llm, prompts)) == want
    stats = llm.llm_engine.stats
    assert stats.prefill_chunks > 0, "no prompt was split into chunks"
    assert stats.mixed_steps > 0, "no step ran a prefill chunk next to a decode"


def test_chunked_prefill_logits(gqa) -> None:
    # A 50-token prompt in chunks of 8: every chunk attends to K/V earlier chunks left in the cache.
    prompt = random_prompts((50,), seed=17)[0]
    llm = make_llm(gqa, max_num_batched_tokens=8, block_size=8)
    logits = llm.llm_engine.prompt_logits([prompt])[0]
    assert llm.llm_engine.stats.prefill_chunks == 6
    diff = (logits - hf_logits(gqa.model, prompt)).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |diff| {diff:.2e}"


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption(gqa, enable_prefix_caching: bool) -> None:
    block_size = 16
    prompts = random_prompts((40, 38, 36, 34), seed=16)
    blocks_needed = [math.ceil((len(p) + NEW_TOKENS) / block_size) for p in prompts]
    num_kv_blocks = max(blocks_needed) + 2  # every request fits alone, the batch does not
    assert sum(blocks_needed) > num_kv_blocks
    want = oracle_greedy(gqa.model, prompts, NEW_TOKENS)
    llm = make_llm(
        gqa, block_size=block_size, num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching
    )
    assert token_ids(generate(llm, prompts)) == want
    assert llm.llm_engine.stats.preemptions > 0


def test_prefix_caching(gqa) -> None:
    block_size = 16
    prefix = random_prompts((40,), seed=17)[0]  # two full blocks and a partial one
    suffixes = random_prompts((3, 7, 12, 20), seed=1017)
    assert len({s[0] for s in suffixes}) == len(suffixes)  # prompts share exactly the prefix
    prompts = [prefix + s for s in suffixes]
    want = oracle_greedy(gqa.model, prompts, NEW_TOKENS)
    llm = make_llm(gqa, block_size=block_size, enable_prefix_caching=True)

    first = generate(llm, prompts[:1])
    hits_before = llm.llm_engine.stats.prefix_hit_tokens
    rest = generate(llm, prompts[1:])
    assert token_ids(first) + token_ids(rest) == want
    # Each later prompt shares exactly the prefix's two full blocks with what is cached.
    shared_full_blocks = len(prefix) // block_size
    hits = llm.llm_engine.stats.prefix_hit_tokens - hits_before
    assert hits == len(suffixes[1:]) * shared_full_blocks * block_size


def test_prefix_cache_full_hit_recomputes_last_token(gqa) -> None:
    """A prompt cached in full still needs the logits of its last token to sample from."""
    prompt = random_prompts((32,), seed=19)[0]  # exactly two blocks
    want = oracle_greedy(gqa.model, [prompt], NEW_TOKENS)
    llm = make_llm(gqa, block_size=16, enable_prefix_caching=True)
    assert token_ids(generate(llm, [prompt])) == want
    hits_before = llm.llm_engine.stats.prefix_hit_tokens
    assert token_ids(generate(llm, [prompt])) == want
    assert llm.llm_engine.stats.prefix_hit_tokens > hits_before


# ---- text and stopping ----


def test_text_is_the_decoded_tokens(gqa) -> None:
    prompts = random_prompts((5, 11, 17, 26, 40), seed=GREEDY_SEED)
    outputs = generate(make_llm(gqa), prompts)
    texts = [gqa.tokenizer.decode(ids, skip_special_tokens=True) for ids in token_ids(outputs)]
    # Random models emit stray bytes, so texts hold U+FFFD; none may end in an incomplete character,
    # which an incremental detokenizer rightly holds back.
    assert all(texts) and not any(t.endswith("\ufffd") for t in texts)
    assert [out.outputs[0].text for out in outputs] == texts


# Prompts on which the tied model's greedy continuation reaches EOS (checked below) or does not.
EOS_PROMPT_SEEDS = tuple(range(500, 508))


def _eos_prompts() -> list[list[int]]:
    return [random_prompts((8 + i % 5 * 4,), seed=seed)[0] for i, seed in enumerate(EOS_PROMPT_SEEDS)]


def test_eos_stops_generation(tied) -> None:
    prompts = _eos_prompts()
    full = oracle_greedy(tied.model, prompts, NEW_TOKENS)
    assert any(EOS_TOKEN_ID in ids for ids in full) and not all(EOS_TOKEN_ID in ids for ids in full)
    outputs = generate(make_llm(tied), prompts, ignore_eos=False)
    for out, ids in zip(outputs, full):
        completion = out.outputs[0]
        if EOS_TOKEN_ID in ids:
            assert list(completion.token_ids) == ids[: ids.index(EOS_TOKEN_ID) + 1]
            assert completion.finish_reason == "stop"
        else:
            assert list(completion.token_ids) == ids
            assert completion.finish_reason == "length"


def test_min_tokens_suppresses_eos(tied) -> None:
    prompts = _eos_prompts()
    want = oracle_greedy(tied.model, prompts, NEW_TOKENS, suppress_eos=True)
    assert want != hf_greedy(tied.model, prompts, NEW_TOKENS)  # suppressing EOS changed something
    outputs = generate(make_llm(tied), prompts, ignore_eos=False, min_tokens=NEW_TOKENS)
    assert token_ids(outputs) == want
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
