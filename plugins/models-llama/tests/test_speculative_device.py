"""N-gram drafts looked up on the device (engine/ngram_device.py) with async scheduling, on a tiny random Llama:
each verify step is launched a step behind, before the one before it is read back, on the inputs the device
computed from that step's outcome (its bonus token, its positions, the next drafts). The output is the plain
path's: greedy token for token (batches, chunked prefill, preemption, requests arriving mid-run, stop strings and
max_tokens inside accepted drafts, logprobs), and sampled with seeds, reproducible. The CPU backend runs the same
torch ops a GPU would, on its own memory."""

from __future__ import annotations

import pytest
from speculation import BIAS, ENGINE, repetitive_prompts, run, stops_and_lengths_match  # (this directory: conftest.py)

from cvllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (every drafting sequence verifies all K drafts with device drafts, whatever the CPU's draft cost)
DEVICE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
          "device_drafts": True}


def assert_lagged(stats) -> None:
    assert stats.spec_lagged_steps > 0 and stats.spec_verifications > 0, stats
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens, stats   # both outcomes seen


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama").path


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 32}, {"num_kv_blocks": 12}, {"mixed": True}],
                         ids=["batch", "chunked-prefill", "preemption", "mixed"])
def test_greedy_output_is_the_plain_paths(path, engine):
    """"mixed": half the sequences' drafts are nearly always rejected (a random model's own output), so they stop
    drafting, and steps run as without device drafts (lagged steps need every sequence to verify K drafts)."""
    mixed = engine.pop("mixed", False)
    prompts = repetitive_prompts(6, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2,
                             logit_bias=BIAS if i % 2 or not mixed else None) for i in range(len(prompts))]
    plain, _ = run(path, prompts, params, None, **engine)
    spec, stats = run(path, prompts, params, DEVICE, async_scheduling=True, **engine)
    assert [[c[:2] for c in out] for out in spec] == [[c[:2] for c in out] for out in plain]
    if not mixed:
        assert_lagged(stats)
    if "num_kv_blocks" in engine:
        assert stats.preemptions > 0


def test_a_lone_sequence_runs_lagged_steps_and_its_logprobs_are_the_plain_paths(path):
    prompts = repetitive_prompts(1, seed=2)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=3, logit_bias=BIAS)
    llm = LLM(model=str(path), **ENGINE)
    plain = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0]
    llm = LLM(model=str(path), **ENGINE, speculative_config=DEVICE, async_scheduling=True)
    spec = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0]
    stats = llm.llm_engine.stats
    assert spec.token_ids == plain.token_ids
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.keys() == b.keys()
        for token in a:
            assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-4)
    assert_lagged(stats)
    # nearly every step after the first verify one is lagged: a step yields its tokens a step later, not slower
    assert stats.spec_lagged_steps >= stats.spec_verifications - 3, stats


def test_stop_strings_and_max_tokens_inside_accepted_drafts(path):
    for stats in stops_and_lengths_match(path, DEVICE, async_scheduling=True):
        assert stats.spec_lagged_steps > 0


def test_requests_arriving_and_ending_mid_run(path):
    """Requests added while others run lagged steps (the engine reads the step in flight back, prefills, and goes
    back to lagged steps), ending at different lengths: each output is the plain path's."""
    prompts = repetitive_prompts(5, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=10 + 9 * i, ignore_eos=True, logit_bias=BIAS)
              for i in range(len(prompts))]

    def staggered(speculative, **engine):
        llm = LLM(model=str(path), **{**ENGINE, **engine}, speculative_config=speculative)
        engine_ = llm.llm_engine
        done: dict[str, list[int]] = {}
        pending = list(range(len(prompts)))
        steps = 0
        while pending or engine_.has_unfinished():
            if pending and steps % 7 == 0:
                i = pending.pop(0)
                engine_.add_request(str(i), prompts[i], params[i])
            for seq in engine_.step():
                if seq.is_finished:
                    done[seq.request_id] = list(seq.output_token_ids)
            steps += 1
        return done, engine_.stats

    plain, _ = staggered(None)
    spec, stats = staggered(DEVICE, async_scheduling=True)
    assert spec == plain
    assert_lagged(stats)


def test_a_full_batch_keeps_lagging_while_requests_wait(path):
    """max_num_seqs 2, six requests: while two run and the rest wait for a free slot, steps stay lagged (a waiting
    request that could not start anyway does not make the engine read each step back)."""
    prompts = repetitive_prompts(6, seed=8)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias=BIAS)
    plain, _ = run(path, prompts, params, None, max_num_seqs=2)
    spec, stats = run(path, prompts, params, DEVICE, async_scheduling=True, max_num_seqs=2)
    assert [[c[:2] for c in out] for out in spec] == [[c[:2] for c in out] for out in plain]
    assert_lagged(stats)
    # between the requests' starts (each a prefill, then a verify step read back): 16 of 55 steps lagged here, 8
    # when every waiting request stopped the lag
    assert stats.spec_lagged_steps * 4 > stats.steps, stats


def test_seeded_sampled_requests_are_reproducible(path):
    prompts = repetitive_prompts(4, seed=4)
    params = [SamplingParams(temperature=1.0 + 0.2 * (i % 2), top_k=2 if i % 3 else 0, seed=i, max_tokens=40,
                             ignore_eos=True, logit_bias=BIAS) for i in range(len(prompts))]
    first, stats = run(path, prompts, params, DEVICE, async_scheduling=True)
    again, _ = run(path, prompts, params, DEVICE, async_scheduling=True)
    assert first == again
    assert_lagged(stats)
    # and each token is one of the two the bias allows: sampled from the model's distribution, not a draft's junk
    assert all(set(c[0]) <= set(BIAS) for out in first for c in out)


def test_off_without_async_scheduling_and_by_default_on_the_cpu(path):
    prompts = repetitive_prompts(2, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias=BIAS)
    _, sync = run(path, prompts, params, DEVICE, async_scheduling=False)
    _, default = run(path, prompts, params, {**DEVICE, "device_drafts": None}, async_scheduling=True)
    assert sync.spec_lagged_steps == default.spec_lagged_steps == 0
