"""Resuming a request on a new engine (what the server's supervisor does after its engine core died): a request added
with the output an earlier engine had produced continues it. Greedy output equals an uninterrupted run token for
token, the resumed tokens count as output (penalties, max_tokens, min_tokens), a grammar's matcher is advanced over
them, and speculative decoding resumes too. Also: NaN or infinite logits fail only their request."""

from __future__ import annotations

import json

import pytest

from cvllm import LLM, SamplingParams
from cvllm.engine_process.deltas import DeltaBuilder
from cvllm.testing.faults import Fault, FaultPlan

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = [(10 + 37 * i) % 480 + 10 for i in range(21)]
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 24}


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama").path


@pytest.fixture(scope="module")
def engine(path):
    return LLM(model=str(path), **ENGINE).llm_engine


def run(engine, request_id: str, prompt: list[int], params: SamplingParams,
        resumed: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """Each completion's whole output (resumed tokens included) once the request has finished."""
    seqs = engine.add_request(request_id, prompt, params, resumed) if resumed is not None \
        else engine.add_request(request_id, prompt, params)
    while engine.has_unfinished():
        engine.step()
    engine.release_request(request_id)
    return {seq.index: seq.output_token_ids for seq in seqs}


@pytest.mark.parametrize("extra", [{}, {"frequency_penalty": 1.5, "repetition_penalty": 1.3},
                                   {"presence_penalty": 2.0, "logprobs": 2}])
def test_greedy_output_resumed_anywhere_equals_the_uninterrupted_run(engine, extra):
    params = SamplingParams(**GREEDY, **extra)
    whole = run(engine, "whole", PROMPT, params)[0]
    assert len(whole) == 24
    for cut in (1, 5, 16, 23):
        assert run(engine, f"cut-{cut}", PROMPT, params, {0: whole[:cut]})[0] == whole, cut


def test_resumed_tokens_count_for_max_tokens_and_min_tokens(engine):
    whole = run(engine, "whole", PROMPT, SamplingParams(**GREEDY))[0]
    seqs = engine.add_request("r", PROMPT, SamplingParams(**GREEDY), {0: whole[:20]})
    while engine.has_unfinished():
        engine.step()
    engine.release_request("r")
    assert seqs[0].num_output_tokens == 24 and seqs[0].finish_reason == "length"
    # min_tokens reads the output so far: with 10 already made, EOS is allowed from the 2nd new token on
    eos = next(iter(engine.eos_token_ids))
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=11, logit_bias={eos: 100.0})
    out = run(engine, "min", PROMPT, params, {0: whole[:10]})[0]
    assert out[:10] == whole[:10] and out[10] != eos and out[11] == eos and len(out) == 12


def test_only_the_unfinished_completions_of_n_resume(engine):
    params = SamplingParams(n=2, temperature=0.0, ignore_eos=True, max_tokens=12)
    whole = run(engine, "whole", PROMPT, params)
    out = run(engine, "half", PROMPT, params, {1: whole[1][:4]})
    assert list(out) == [1] and out[1] == whole[1]


def test_deltas_of_a_resumed_request_start_after_what_was_sent(engine):
    params = SamplingParams(**GREEDY, logprobs=1)
    whole = run(engine, "whole", PROMPT, params)[0]
    builder = DeltaBuilder(engine)
    seqs = engine.add_request("r", PROMPT, params, {0: whole[:8]})
    builder.resumed(seqs)
    sent = []
    while engine.has_unfinished():
        for delta in builder.deltas(engine.step()):
            assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
            assert delta.prompt_logprobs is None and delta.num_cached_tokens == 0
            sent += delta.token_ids
    engine.release_request("r")
    assert whole[:8] + sent == whole


def test_a_constrained_request_resumes_inside_its_grammar(path):
    engine = LLM(model=str(path), **ENGINE).llm_engine
    schema = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": schema})
    whole = run(engine, "whole", PROMPT, params)[0]
    text = engine.tokenizer.decode(whole, skip_special_tokens=True)
    assert json.loads(text).keys() == {"name", "age"}
    for cut in (1, len(whole) // 2):
        assert run(engine, f"cut-{cut}", PROMPT, params, {0: whole[:cut]})[0] == whole


def test_a_speculating_engine_resumes_greedy_output_unchanged(path):
    engine = LLM(model=str(path), **ENGINE, speculative_config=NGRAM).llm_engine
    prompt = PROMPT[:6] * 4
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    whole = run(engine, "whole", prompt, params)[0]
    for cut in (3, 17):
        assert run(engine, f"cut-{cut}", prompt, params, {0: whole[:cut]})[0] == whole
    assert engine.stats.spec_verifications > 0


def test_nan_logits_fail_only_their_request(path):
    poisoned = 499
    llm = LLM(model=str(path), **ENGINE)
    FaultPlan.of(Fault("sample", "nan", prompt_token=poisoned)).install(llm.llm_engine)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
    bad, good = llm.generate([{"prompt_token_ids": [poisoned, 5, 6]}, {"prompt_token_ids": PROMPT}], params)
    assert bad.outputs[0].finish_reason == "error" and bad.outputs[0].token_ids == []
    clean = LLM(model=str(path), **ENGINE).generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert good.outputs[0].token_ids == clean.outputs[0].token_ids


@pytest.mark.parametrize("n", [1, 2])
def test_seeded_sampling_resumes_its_random_stream(engine, n):
    params = SamplingParams(n=n, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True, max_tokens=20)
    whole = run(engine, "whole", PROMPT, params)
    for cut in (1, 9):
        assert run(engine, f"cut-{cut}", PROMPT, params, {i: whole[i][:cut] for i in range(n)}) == whole
