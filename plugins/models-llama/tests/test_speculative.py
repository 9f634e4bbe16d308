"""N-gram speculative decoding on a tiny random Llama: greedy output equals the plain engine's token for token
(batches, chunked prefill, preemption, stops inside accepted drafts, max_tokens, logprobs). That sampled output has
the target's exact distribution, for both methods, is tested in test_draft_model.py."""

from __future__ import annotations

import pytest
from speculation import ENGINE, NGRAM, repetitive_prompts, run  # (this directory: conftest.py)

from cvllm import LLM, SamplingParams
from cvllm.engine.speculative import SpeculativeConfig, accepted, draft_length, propose_ngram

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama").path


def test_propose_ngram_copies_what_followed_the_latest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3, 1, 3) == [7, 1, 2]
    assert propose_ngram([5, 6, 7, 8, 6], 2, 1, 3) == [7, 8]        # only the 1-gram matches
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []               # nothing repeats
    assert propose_ngram([4, 4], 3, 2, 3) == []                     # too short for the smallest n
    assert accepted([5, 6, 7], [5, 6, 1, 2]) == 2 and accepted([5], [4, 9]) == 0


def test_bad_configs_are_refused():
    for bad in ({"method": "medusa"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, {"method": "ngram", "k": 3},
                {"method": "draft_model"}, {"method": "ngram", "model": "x"},
                {"method": "ngram", "draft_token_cost": -0.1}):
        with pytest.raises(ValueError, match="speculative_config"):
            SpeculativeConfig.from_dict(bad)


def test_draft_length_is_what_pays_for_its_cost():
    """Drafts a sequence verifies (speculative.draft_length): all of them where a draft costs nothing or nearly every
    one is accepted; fewer where they cost much and are often wrong; never fewer for a better record."""
    assert draft_length(0, 50, 0.0, 4) == 4 and draft_length(500, 2, 0.2, 8) == 8
    assert draft_length(5, 20, 0.2, 4) == 1 and draft_length(0, 0, 0.2, 1) == 1
    assert draft_length(0, 0, 0.04, 4) == 4 and draft_length(0, 0, 0.2, 4) == 3   # the prior: 0.75
    for cost in (0.04, 0.2, 1.0):
        lengths = [draft_length(accepted_, 10, cost, 6) for accepted_ in range(0, 200, 5)]
        assert lengths == sorted(lengths)


def test_costly_drafts_are_fewer_and_change_no_token(path):
    """Where a draft costs as much as a step, sequences whose drafts fail verify fewer of them; the tokens are the
    same whatever the number (and the same as without speculation)."""
    prompts = repetitive_prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = run(path, prompts, params, None)
    free, free_stats = run(path, prompts, params, {**NGRAM, "draft_token_cost": 0})
    costly, costly_stats = run(path, prompts, params, {**NGRAM, "draft_token_cost": 1.0})
    assert free == plain and costly == plain
    per_step = [s.spec_draft_tokens / s.spec_verifications for s in (free_stats, costly_stats)]
    assert per_step[1] < per_step[0], per_step


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 10}],
                         ids=["batch", "chunked-prefill", "preemption"])
def test_greedy_output_is_the_same_token_for_token(path, engine):
    prompts = repetitive_prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    plain, plain_stats = run(path, prompts, params, None, **engine)
    spec, stats = run(path, prompts, params, NGRAM, **engine)
    assert [[c[:2] for c in out] for out in spec] == [[c[:2] for c in out] for out in plain]
    assert stats.spec_verifications > 0 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    if "num_kv_blocks" in engine:
        assert stats.preemptions > 0
    else:   # verify chunks (cut short by the token budget or not) never count as prompt tokens
        assert stats.prompt_tokens_computed == plain_stats.prompt_tokens_computed == sum(map(len, prompts))


def test_logprobs_and_max_tokens_stay_right(path):
    prompts = repetitive_prompts(3, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in (1, 2, 7)]
    llms = [LLM(model=str(path), **ENGINE, speculative_config=spec) for spec in (None, NGRAM)]
    plain, spec = (llm.generate([{"prompt_token_ids": p} for p in prompts], params) for llm in llms)
    for a, b, p in zip(plain, spec, params):
        assert len(b.outputs[0].token_ids) == p.max_tokens and a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys() and all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)


def test_a_stop_string_inside_accepted_drafts_ends_the_text_there(path):
    prompts = repetitive_prompts(4, seed=3)
    # two tokens favoured far above the rest: the output is made of them, so drafts copied from it are often
    # right (and sometimes wrong)
    bias = {300: 100.0, 301: 100.0}
    free, _ = run(path, prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias=bias),
                  None)
    # a stop string from the middle of each output: it may arrive inside a step's accepted drafts
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias=bias,
                             stop=[out[0][2][20:26]]) for out in free]
    plain = [LLM(model=str(path), **ENGINE).generate([{"prompt_token_ids": p}], s)[0].outputs[0]
             for p, s in zip(prompts, params)]
    spec_llm = LLM(model=str(path), **ENGINE, speculative_config=NGRAM)
    spec = [spec_llm.generate([{"prompt_token_ids": p}], s)[0].outputs[0] for p, s in zip(prompts, params)]
    assert [(c.text, c.finish_reason) for c in spec] == [(c.text, c.finish_reason) for c in plain]
    assert spec_llm.llm_engine.stats.spec_accepted_tokens > 0


def test_cvserve_with_speculation_streams_the_same_text_and_counts_it(path):
    import httpx
    import openai

    from cvllm.testing.server import LiveServer

    prompt = repetitive_prompts(1, seed=3)[0]
    want = LLM(model=str(path), **ENGINE).generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, logit_bias={300: 100.0, 301: 100.0}))[0].outputs[0].text
    engine = {"model": str(path), **ENGINE, "backend": "cpu", "speculative_config": NGRAM}
    with LiveServer(engine, served_model_names=["tiny"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0, stream=True,
                                           logit_bias={"300": 100, "301": 100}, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        metrics = httpx.get(server.url + "/metrics").text
    assert streamed == want
    accepted = next(line for line in metrics.splitlines() if line.startswith("cvllm:spec_decode_num_accepted_tokens"))
    assert float(accepted.rsplit(" ", 1)[1]) > 0


def test_grammar_rows_and_speculating_rows_share_a_batch(path):
    import json

    prompts = repetitive_prompts(2, seed=1)
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a"], "additionalProperties": False}
    structured = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})
    plain, _ = run(path, prompts, [free, structured], None)
    spec, stats = run(path, prompts, [free, structured], NGRAM)
    assert spec == plain and stats.spec_verifications > 0
    assert json.loads(spec[1][0][2])["a"] in range(100)
