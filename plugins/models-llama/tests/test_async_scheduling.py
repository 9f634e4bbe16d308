"""Async scheduling (a step launched before the previous step's tokens are read back) gives exactly the
outputs of synchronous steps: same tokens, logprobs, finish reasons, through chunked prefill, preemption,
prefix caching, stops, seeded sampling and aborts. On the CPU it is off by default; here it is forced on,
and each test checks that steps really overlapped."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cvllm import LLM, SamplingParams
from cvllm.engine.sampler import Sampler
from cvllm.testing import hf_greedy

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ENGINE = {"dtype": "float32", "block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64}


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in lengths]


def run(checkpoint, async_scheduling: bool, requests: list[tuple[list[int], SamplingParams]], **engine: Any):
    llm = LLM(model=str(checkpoint.path), **{**ENGINE, **engine}, async_scheduling=async_scheduling)
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [params for _, params in requests])
    result = [[(list(c.token_ids), c.finish_reason, c.logprobs) for c in out.outputs] for out in outputs]
    return result, llm.llm_engine.stats


def logprob_values(entries) -> list[dict[int, float]] | None:
    return None if entries is None else [{t: lp.logprob for t, lp in entry.items()} for entry in entries]


def assert_same(checkpoint, requests, expect_overlap: bool = True, **engine: Any):
    sync, _ = run(checkpoint, False, requests, **engine)
    overlapped, stats = run(checkpoint, True, requests, **engine)
    for got, want in zip(overlapped, sync, strict=True):
        assert [(tokens, reason) for tokens, reason, _ in got] == [(tokens, reason) for tokens, reason, _ in want]
        for (_, _, got_lp), (_, _, want_lp) in zip(got, want):
            # a stopped sequence rides along one extra step, so batches differ in shape: fp32 sums may
            # round differently, the tokens may not
            got_lp, want_lp = logprob_values(got_lp), logprob_values(want_lp)
            assert (got_lp is None) == (want_lp is None)
            for g, w in zip(got_lp or [], want_lp or [], strict=True):
                assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-4 for t in g)
    if expect_overlap:
        assert stats.overlapped_steps > 0, "no step was launched before the previous one was read back"
    else:
        assert stats.overlapped_steps == 0, "a step that needed every token on the host overlapped"
    return sync, stats


@pytest.fixture(scope="module")
def gqa(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def tied(tiny_checkpoint):
    return tiny_checkpoint("llama", spelling="published", tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 1000000.0})


def test_greedy_with_chunked_prefill_equals_transformers(gqa) -> None:
    ps = prompts((5, 11, 17, 26, 40, 70), seed=118)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sync, stats = assert_same(gqa, [(p, params) for p in ps], max_num_batched_tokens=32)
    assert [out[0][0] for out in sync] == hf_greedy(gqa.model, ps, 24)
    assert stats.prefill_chunks > 0 and stats.mixed_steps > 0


def test_preemption_and_prefix_caching(gqa) -> None:
    prefix = prompts((40,), seed=3)[0]
    ps = [prefix + tail for tail in prompts((3, 9, 14, 20), seed=4)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, stats = assert_same(gqa, [(p, params) for p in ps], num_kv_blocks=9)
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0


def test_stops_max_tokens_and_logprobs(tied) -> None:
    ps = prompts((6, 13, 21, 9, 30), seed=21)
    # 392 and 233 come up early in two of these greedy continuations: those stop, the others run to max_tokens
    requests = [(p, SamplingParams(temperature=0, max_tokens=m, logprobs=2, stop_token_ids=[392, 233]))
                for p, m in zip(ps, (40, 3, 17, 40, 1))]
    sync, _ = assert_same(tied, requests)
    reasons = [out[0][1] for out in sync]
    assert reasons.count("stop") >= 2 and "length" in reasons, reasons


def test_seeded_sampling_with_n(gqa) -> None:
    ps = prompts((8, 19, 33), seed=5)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, n=2, seed=1234, max_tokens=20, ignore_eos=True)
    sync, _ = assert_same(gqa, [(p, params) for p in ps])
    assert sync[0][0][0] != sync[0][1][0][0]    # the two completions really sampled


def test_steps_that_need_every_token_run_synchronously(gqa) -> None:
    """A pending min_tokens (its stop-id mask counts the host's tokens) keeps every step of the batch
    synchronous; so does a prompt whose logprobs are still being computed."""
    ps = prompts((7, 15), seed=8)
    requests = [(ps[0], SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True)),
                (ps[1], SamplingParams(temperature=0, max_tokens=12, min_tokens=12, prompt_logprobs=1))]
    assert_same(gqa, requests, expect_overlap=False)


def test_abort_while_a_step_is_in_flight(gqa) -> None:
    ps = prompts((12, 20), seed=9)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(model=str(gqa.path), **ENGINE, async_scheduling=True)
    engine = llm.llm_engine
    engine.add_request("keep", ps[0], params)
    engine.add_request("drop", ps[1], params)
    for _ in range(4):
        engine.step()
    assert engine.has_step_in_flight
    engine.abort_request("drop")
    while engine.has_unfinished():
        engine.step()
    kept = engine.requests["keep"][0]
    assert kept.output_token_ids == hf_greedy(gqa.model, [ps[0]], 16)[0]
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fake_model_runner_steps(gqa, async_scheduling) -> None:
    """--fake-step-ms (no model: the HTTP stack's benchmarks) runs through the same step(), async or not."""
    ps = prompts((9, 30), seed=10)
    llm = LLM(model=str(gqa.path), **ENGINE, fake_step_ms=0, async_scheduling=async_scheduling)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=7, ignore_eos=True))
    assert [len(out.outputs[0].token_ids) for out in outputs] == [7, 7]
    assert (llm.llm_engine.stats.overlapped_steps > 0) == async_scheduling


@pytest.fixture(scope="module")
def small_vocab(tiny_checkpoint):
    """48 tokens: 24 greedy tokens must repeat some, so penalties change what greedy picks."""
    return tiny_checkpoint("llama", vocab_size=48)


def test_penalties_overlap_and_match_transformers(small_vocab, monkeypatch) -> None:
    """Penalties read token counts kept on the device, so their steps overlap. Oracles: transformers for the
    repetition penalty (RepetitionPenaltyLogitsProcessor, prompt + output), and for every penalty the
    sampler's host path (histories rebuilt from complete token lists, in synchronous steps), through a
    batch that queues (max_num_seqs 2: history rows freed and reused) and one that preempts."""
    checkpoint = small_vocab
    ps = [[t % 45 + 3 for t in p] for p in prompts((7, 15, 22, 9), seed=11)]
    repetition = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5, ignore_eos=True)
    requests = [(ps[0], repetition),
                (ps[1], SamplingParams(temperature=0, max_tokens=20, frequency_penalty=0.8, presence_penalty=0.4,
                                       ignore_eos=True)),
                (ps[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
                (ps[3], SamplingParams(temperature=0.8, seed=5, max_tokens=16, frequency_penalty=1.1, ignore_eos=True))]
    plain = [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for p in ps[:2]]
    unpenalised, _ = run(checkpoint, False, plain)
    with torch.no_grad():
        want = checkpoint.model.generate(torch.tensor([ps[0]]), max_new_tokens=24, do_sample=False,
                                         repetition_penalty=1.5, eos_token_id=[], pad_token_id=0)[0, len(ps[0]):]
    want = want.tolist()

    host_lists = Sampler.__call__
    with monkeypatch.context() as patch:   # the reference: no device history, token lists read each step
        patch.setattr(Sampler, "__call__",
                      lambda self, logits, rows, history=None, allowed=None: host_lists(self, logits, rows))
        reference, _ = run(checkpoint, False, requests, max_num_seqs=2)
    for engine in ({"max_num_seqs": 2}, {"num_kv_blocks": 5}):
        got, stats = run(checkpoint, True, requests, **engine)
        assert [[c[:2] for c in out] for out in got] == [[c[:2] for c in out] for out in reference]
        assert stats.overlapped_steps > 0
    assert stats.preemptions > 0
    assert reference[0][0][0] == want
    # the penalties changed what greedy picks, so the comparisons above could fail
    assert reference[0][0][0] != unpenalised[0][0][0] and reference[1][0][0][:20] != unpenalised[1][0][0][:20]


def test_every_way_a_sequence_ends_frees_its_penalty_row(small_vocab) -> None:
    """Length, stop token, stop string (finish_sequence) and abort each give the sequence's history row back."""
    llm = LLM(model=str(small_vocab.path), **ENGINE, async_scheduling=True)
    engine = llm.llm_engine
    ps = [[t % 45 + 3 for t in p] for p in prompts((7, 9, 11, 13), seed=13)]
    penalised = dict(temperature=0, frequency_penalty=0.5, ignore_eos=True)
    engine.add_request("length", ps[0], SamplingParams(max_tokens=3, **penalised))
    engine.add_request("stop-token", ps[1], SamplingParams(max_tokens=40, stop_token_ids=list(range(48)),
                                                           **penalised))
    engine.add_request("stop-string", ps[2], SamplingParams(max_tokens=40, **penalised))
    engine.add_request("abort", ps[3], SamplingParams(max_tokens=40, **penalised))
    for _ in range(4):
        engine.step()
    assert len(engine.executor.penalties) == 2                       # "length" and "stop-token" are done
    engine.finish_sequence(engine.requests["stop-string"][0], "stop", "x")
    engine.abort_request("abort")
    while engine.has_unfinished():
        engine.step()
    assert len(engine.executor.penalties) == 0
    assert [seq.finish_reason for seq in engine.requests["length"] + engine.requests["stop-token"]] == \
        ["length", "stop"]
