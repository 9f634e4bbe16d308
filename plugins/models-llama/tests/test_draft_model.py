"""Draft-model speculative decoding on tiny random Llamas: greedy output equals the plain engine's token for token
(batches of different lengths, chunked prefill, preemption, async steps, prefix-cache hits, stop strings, max_tokens),
the target as its own draft has every draft accepted (its KV cache mirrors the target's), sampled output has the
target's distribution (a chi-square test against the exact one), and a draft of another vocabulary is refused."""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from cvllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 128}


def random_prompts(lengths, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def draft_config(draft: Path, k: int = 4, **more) -> dict:
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k, **more}


def run(path, prompts, params, speculative: dict | None, **engine):
    llm = LLM(model=str(path), **{**ENGINE, **engine}, speculative_config=speculative)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[(list(c.token_ids), c.finish_reason, c.text) for c in out.outputs] for out in outputs], \
        llm.llm_engine.stats


def acceptance(stats) -> float:
    return stats.spec_accepted_tokens / stats.spec_draft_tokens


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama").path


@pytest.fixture(scope="module")
def noisy_draft(path, tmp_path_factory) -> Path:
    """The target with noise on its matrices (3% of each one's spread): a draft that agrees with the target about
    half the time."""
    from safetensors.torch import load_file, save_file

    draft = tmp_path_factory.mktemp("noisy-draft") / "draft"
    shutil.copytree(path, draft)
    generator = torch.Generator().manual_seed(0)
    for file in draft.glob("*.safetensors"):
        tensors = {name: t + 0.03 * t.std() * torch.randn(t.shape, generator=generator) if t.ndim == 2 else t
                   for name, t in load_file(file).items()}
        save_file(tensors, file, metadata={"format": "pt"})
    return draft


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 8},
                                    {"async_scheduling": True, "max_num_seqs": 12}],
                         ids=["batch", "chunked-prefill", "preemption", "async"])
@pytest.mark.parametrize("which", ["self", "noisy"])
def test_greedy_output_is_the_same_token_for_token(path, noisy_draft, engine, which):
    """Prompts of different lengths; with async scheduling, 12 sequences of different lengths start above
    disable_by_batch_size (async steps, no drafts) and speculate once fewer remain: the draft's cache was kept
    by its shadow of the async steps."""
    lengths = (3, 17, 40, 70, 9, 25) * (2 if "async_scheduling" in engine else 1)
    prompts = random_prompts(lengths, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=10 + 3 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    draft = path if which == "self" else noisy_draft
    plain, _ = run(path, prompts, params, None, **engine)
    spec, stats = run(path, prompts, params, draft_config(draft), **engine)
    assert [[c[:2] for c in out] for out in spec] == [[c[:2] for c in out] for out in plain]
    assert stats.spec_verifications > 0
    if which == "self":
        assert acceptance(stats) > 0.97, (stats.spec_accepted_tokens, stats.spec_draft_tokens)
    else:
        assert 0.1 < acceptance(stats) < 0.9
    if "num_kv_blocks" in engine:
        assert stats.preemptions > 0
    if "async_scheduling" in engine:
        assert stats.overlapped_steps > 0


def test_prefix_cache_hits_hold_the_drafts_kv_too(path):
    """Requests one after another that share a 48-token prefix: the later ones take it from the prefix cache,
    and the target as its own draft still has every draft accepted (the cached blocks hold the draft's KV)."""
    shared = random_prompts([48], seed=2)[0]
    prompts = [shared + tail for tail in random_prompts((5, 20, 1, 33), seed=3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llms = [LLM(model=str(path), **ENGINE, speculative_config=spec) for spec in (None, draft_config(path))]
    plain, spec = ([llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
                   for llm in llms)
    stats = llms[1].llm_engine.stats
    assert spec == plain and stats.prefix_hit_tokens >= 3 * 48
    assert acceptance(stats) > 0.97


def test_stop_strings_and_max_tokens_stay_right(path):
    prompts = random_prompts((6, 30, 12, 50), seed=4)
    free, _ = run(path, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), None)
    # a stop string from the middle of each output: with the target as its draft it falls inside accepted drafts
    stops = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[out[0][2][20:26]]) for out in free]
    plain, _ = run(path, prompts, stops, None)
    spec, stats = run(path, prompts, stops, draft_config(path))
    assert [c[0][1:] for c in spec] == [c[0][1:] for c in plain] and stats.spec_accepted_tokens > 0
    assert all(c[0][1] == "stop" for c in spec)
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (1, 2, 3, 7)]
    llms = [LLM(model=str(path), **ENGINE, speculative_config=spec) for spec in (None, draft_config(path, k=5))]
    plain, spec = (llm.generate([{"prompt_token_ids": p} for p in prompts], lengths) for llm in llms)
    for a, b, p in zip(plain, spec, lengths):
        assert len(b.outputs[0].token_ids) == p.max_tokens and a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_a_config_naming_a_model_means_a_draft_model():
    from cvllm.engine.speculative import SpeculativeConfig

    config = SpeculativeConfig.from_dict({"model": "draft", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "draft", 3)


def test_a_draft_of_another_vocabulary_is_refused(path, tiny_checkpoint):
    other = tiny_checkpoint("llama", vocab_size=640).path
    with pytest.raises(ValueError, match="vocabulary of 640 tokens and the target .* one of 512"):
        LLM(model=str(path), **ENGINE, speculative_config=draft_config(other))


def wilson_hilferty_quantile(df: int, z: float) -> float:
    """The chi-square distribution's quantile at standard normal quantile ``z`` (Wilson and Hilferty's
    approximation: within a percent for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("which", ["plain", "ngram", "self", "noisy"])
def test_sampled_output_has_the_targets_exact_distribution(path, noisy_draft, which):
    """3000 seeded requests of three tokens at temperature 1 and top-k: the joint frequencies of (t0, t1, t2) against
    the target's own probabilities p(t0) p(t1 | t0) p(t2 | t0, t1), computed from its logits, by a chi-square test
    (p > 0.001). t1 is sampled at a verify step's first row (its draft accepted with probability p(draft)), t2 at its
    second row or, after a rejection, in a plain decode. "plain" (no speculation) checks the test itself; "ngram"
    favours three tokens far above the rest (the prompt holds them in some order, so every step has n-gram drafts);
    the draft models run on the target's own logits (the target as its draft: acceptance p(argmax), about 0.4)."""
    n, temperature = 3000, 1.0
    prompt = random_prompts([8], seed=5)[0]
    bias, top_k = {}, 4
    speculative = {"disable_by_batch_size": 1000, "min_acceptance_rate": 0.0}
    if which == "plain":
        speculative = None
    elif which == "ngram":
        bias, top_k = {300: 100.0, 301: 100.0, 302: 100.0}, 3
        prompt += [300, 301, 302, 301, 300, 302, 300]
        speculative |= {"method": "ngram", "num_speculative_tokens": 2}
    else:
        speculative |= draft_config(path if which == "self" else noisy_draft, k=2)
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=s, max_tokens=3, ignore_eos=True,
                             logit_bias=bias or None) for s in range(n)]
    outputs, stats = run(path, [prompt] * n, params, speculative, max_num_seqs=256, max_num_batched_tokens=4096)
    if speculative is not None:
        assert stats.spec_verifications >= n and 0.1 < acceptance(stats) < 0.9
    seen = Counter(tuple(out[0][0]) for out in outputs)

    llm = LLM(model=str(path), **ENGINE)

    def given(prefix: list[int]) -> dict[int, float]:
        """The sampler's probabilities after ``prompt + prefix``: logit bias, temperature, top-k."""
        logits = llm.llm_engine.prompt_logits([prompt + prefix])[0][-1]
        for token, value in bias.items():
            logits[token] += value
        top = torch.topk(logits / temperature, top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()))

    exact = {(t0, t1, t2): q0 * q1 * q2 for t0, q0 in given([]).items() for t1, q1 in given([t0]).items()
             for t2, q2 in given([t0, t1]).items()}
    assert set(seen) <= set(exact)
    # cells expected fewer than 5 times pooled into one, as a chi-square test wants
    small = [cell for cell, q in exact.items() if q * n < 5]
    cells = [([cell], q) for cell, q in exact.items() if q * n >= 5] + [(small, sum(exact[c] for c in small))]
    statistic = sum((sum(seen[c] for c in group) - q * n) ** 2 / (q * n) for group, q in cells if q > 0)
    assert statistic < wilson_hilferty_quantile(len(cells) - 1, 3.09), (statistic, len(cells))


def test_cvserve_with_a_draft_model_streams_the_same_text_and_counts_it(path):
    import json

    import httpx
    import openai

    from cvllm.server.cli import build_server_args
    from cvllm.testing.server import LiveServer, free_port

    prompt = random_prompts([12], seed=6)[0]
    want = LLM(model=str(path), **ENGINE).generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0].text
    args = build_server_args(["--w", str(path), "--p", str(free_port()), "--backend", "cpu", "--dtype", "f32",
                              "--max-num-seqs", "8", "--num-kv-blocks", "64", "--served-model-name", "tiny",
                              "--speculative-config", json.dumps(draft_config(path))])
    spec = dataclasses.asdict(args)
    engine = spec.pop("engine")
    engine.pop("fault_injector")   # (a test seam, unset: not a JSON value)
    with LiveServer(engine, **spec) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        metrics = httpx.get(server.url + "/metrics").text
    assert streamed == want

    def counter(name: str) -> float:
        return float(next(line for line in metrics.splitlines() if line.startswith(name)).rsplit(" ", 1)[1])

    assert counter("cvllm:spec_decode_num_accepted_tokens") >= 0.9 * counter("cvllm:spec_decode_num_draft_tokens") > 0
