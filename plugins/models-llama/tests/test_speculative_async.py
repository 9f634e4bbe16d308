"""Asynchronous n-gram speculative steps (engine/speculator.py) on a tiny random Llama: each step launched on a guess
of the in-flight verify step's outcome gives the synchronous path's output: greedy token for token (batches, chunked
prefill, preemption, stop strings and max_tokens inside accepted drafts, logprobs), and seeded sampled requests the
same draws. Both sides of the guess are exercised: steps launched on a right guess, and void ones after a wrong one."""

from __future__ import annotations

import pytest
import torch
from speculation import (  # (this directory: conftest.py)
    BIAS,
    ENGINE,
    NGRAM,
    repetitive_prompts,
    run,
    stops_and_lengths_match,
)

from cvllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_guessed_both_ways(stats) -> None:
    assert stats.spec_guesses > stats.spec_guess_misses > 0, (stats.spec_guesses, stats.spec_guess_misses)
    assert stats.overlapped_steps > 0 and stats.spec_verifications > 0


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return tiny_checkpoint("llama").path


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 16}, {"num_kv_blocks": 10}],
                         ids=["batch", "chunked-prefill", "preemption"])
def test_greedy_output_is_the_synchronous_paths(path, engine):
    prompts = repetitive_prompts(6, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2,
                             logit_bias=BIAS if i % 2 else None) for i in range(len(prompts))]
    plain, _ = run(path, prompts, params, None, **engine)
    spec, stats = run(path, prompts, params, NGRAM, async_scheduling=True, **engine)
    assert [[c[:2] for c in out] for out in spec] == [[c[:2] for c in out] for out in plain]
    assert_guessed_both_ways(stats)
    if "num_kv_blocks" in engine:
        assert stats.preemptions > 0


def test_stop_strings_and_max_tokens_inside_accepted_drafts(path):
    for stats in stops_and_lengths_match(path, NGRAM, async_scheduling=True):
        assert stats.spec_guesses > 0


def test_seeded_sampled_requests_make_the_synchronous_paths_draws(path):
    """Sampled with seeds: the same tokens as the synchronous path, from the same drafts (a step launched on a wrong
    guess draws from the sequence's generator, which is set back; where the bonus token cannot be guessed, the step
    waits, so that the drafts stay the synchronous path's)."""
    prompts = repetitive_prompts(6, seed=4)
    params = [SamplingParams(temperature=1.0 + 0.2 * (i % 2), top_k=2 if i % 3 else 0, seed=i, max_tokens=40,
                             ignore_eos=True, logit_bias=BIAS) for i in range(len(prompts))]
    sync, sync_stats = run(path, prompts, params, NGRAM)
    spec, stats = run(path, prompts, params, NGRAM, async_scheduling=True)
    assert spec == sync
    assert_guessed_both_ways(stats)
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens) == (sync_stats.spec_draft_tokens,
                                                                     sync_stats.spec_accepted_tokens)


def test_a_batch_past_disable_by_batch_size_overlaps_and_then_speculates(path):
    """12 sequences (more than disable_by_batch_size 8) of different lengths: plain async steps first, verify steps
    launched on guesses once fewer remain."""
    generator = torch.Generator().manual_seed(5)
    prompts = [p[:int(torch.randint(4, len(p) + 1, (1,), generator=generator))] for p in repetitive_prompts(12, 5)]
    params = [SamplingParams(temperature=0, max_tokens=8 + 4 * i, ignore_eos=True, logit_bias=BIAS)
              for i in range(len(prompts))]
    plain, _ = run(path, prompts, params, None, max_num_seqs=12)
    spec, stats = run(path, prompts, params, NGRAM, async_scheduling=True, max_num_seqs=12)
    assert spec == plain
    assert_guessed_both_ways(stats)


def test_a_sequence_whose_guesses_fail_waits_for_its_outcomes(path, monkeypatch):
    """Every guess wrong (a random model's greedy output, drafts copied from a repeated phrase, and the guess's
    bonus token after them): with the floor off, each one voids a step; with it, a sequence stops being guessed for
    after a miss, runs its verify steps synchronously, and its output is the same."""
    from cvllm.engine import speculator

    prompts = repetitive_prompts(3, seed=6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, _ = run(path, prompts, params, None)
    monkeypatch.setattr(speculator, "GUESS_MIN_RATE", 0.0)
    always, always_stats = run(path, prompts, params, NGRAM, async_scheduling=True)
    monkeypatch.undo()
    floored, stats = run(path, prompts, params, NGRAM, async_scheduling=True)
    assert always == floored == plain
    assert always_stats.spec_guess_misses > 2 * len(prompts)
    # a guess wrong drops a sequence's rate for its kind of guess below the floor at once (1.0 -> 0.75); back above it
    # takes a guess that would have held, which the model makes rare here
    assert stats.spec_guess_misses < always_stats.spec_guess_misses / 2, (stats.spec_guess_misses,
                                                                          always_stats.spec_guess_misses)
    assert stats.spec_verifications > 0


def test_a_held_sequence_is_read_back_and_stepped_again_in_one_call(path):
    """A sequence the speculator holds (its guesses fail) waits for its outcome; the step that reads it back launches
    its next step too, before the caller handles the tokens: no step() call only reads a step back, but the last."""
    prompts = repetitive_prompts(2, seed=6)
    llm = LLM(model=str(path), **ENGINE, speculative_config=NGRAM, async_scheduling=True)
    records = []

    class Keep:
        device_timing = False
        on_step = staticmethod(records.append)

    with llm.llm_engine.observers.observing(Keep()):
        spec = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    plain, _ = run(path, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), None)
    assert [[(list(c.token_ids), c.finish_reason, c.text) for c in out.outputs] for out in spec] == plain
    stats = llm.llm_engine.stats
    assert stats.spec_verifications > 0 and stats.overlapped_steps < stats.steps   # some steps waited
    only_read_back = [r.index for r in records if not r.num_seqs]
    assert only_read_back == [records[-1].index] or not only_read_back, only_read_back
