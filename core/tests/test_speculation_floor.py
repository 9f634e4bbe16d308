"""The per-sequence acceptance floor of speculative decoding (engine/speculator.py): a sequence whose drafts are
rarely right stops drafting, and tries again REPROBE_TOKENS later with a fresh record. Driven through the
Speculator's own budget and settle on a bare scheduler (no model: which drafts a model accepts is not the point)."""

from __future__ import annotations

from types import SimpleNamespace

from cvllm import SamplingParams
from cvllm.engine.scheduler import EngineStats
from cvllm.engine.sequence import Sequence
from cvllm.engine.speculative import MIN_PROPOSALS, REPROBE_TOKENS, SpeculativeConfig
from cvllm.engine.speculator import Speculator

K = 4


def speculator() -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=K, min_acceptance_rate=0.25)
    return Speculator(config, SimpleNamespace(stats=EngineStats(), running=[]), max_model_len=10_000)


def verify(spec: Speculator, seq: Sequence, right: int) -> None:
    """A verify step of K drafts, ``right`` of them accepted, read back: its tokens appended as the engine does."""
    drafts = [7] * K
    targets = [7] * right + [8] * (K + 1 - right)
    seq.token_ids.extend(spec.settle(seq, drafts, targets))


def budget(spec: Speculator, seq: Sequence) -> int:
    return spec.budget(seq, len(seq.token_ids), seq.spec_proposed, seq.spec_accepted, seq.spec_rejections)


def test_a_sequence_below_the_floor_stops_then_tries_again_with_a_fresh_record():
    spec = speculator()
    seq = Sequence(0, "r", list(range(1, 11)), SamplingParams(max_tokens=5000))
    assert budget(spec, seq) == K
    for _ in range(MIN_PROPOSALS // K):
        stopped = len(seq.token_ids)                # (where the step that crossed the floor started)
        verify(spec, seq, right=0)
    assert seq.spec_stopped_at == stopped and budget(spec, seq) == 0
    # a step launched before it stopped, read back now, is no probe: the record stands
    verify(spec, seq, right=0)
    assert seq.spec_proposed == MIN_PROPOSALS + K and seq.spec_stopped_at == stopped
    seq.token_ids.extend([9] * (stopped + REPROBE_TOKENS - 1 - len(seq.token_ids)))
    assert budget(spec, seq) == 0                   # one token short of trying again
    seq.token_ids.append(9)
    assert budget(spec, seq) == K                   # a probe
    verify(spec, seq, right=K)                      # ... that was right: the record starts afresh from it
    assert (seq.spec_proposed, seq.spec_accepted, seq.spec_stopped_at) == (K, K, None)
    assert budget(spec, seq) == K


def test_a_probe_that_fails_again_stops_the_sequence_for_another_stretch():
    spec = speculator()
    seq = Sequence(0, "r", list(range(1, 11)), SamplingParams(max_tokens=5000))
    for _ in range(MIN_PROPOSALS // K):
        verify(spec, seq, right=0)
    seq.token_ids.extend([9] * REPROBE_TOKENS)
    for _ in range(MIN_PROPOSALS // K):             # the probe: MIN_PROPOSALS drafts before the floor applies
        assert budget(spec, seq) == K
        stopped = len(seq.token_ids)
        verify(spec, seq, right=0)
    assert seq.spec_stopped_at == stopped and budget(spec, seq) == 0


def test_a_sequence_at_the_floor_keeps_drafting():
    spec = speculator()
    seq = Sequence(0, "r", list(range(1, 11)), SamplingParams(max_tokens=5000))
    for _ in range(MIN_PROPOSALS // K):
        verify(spec, seq, right=1)                  # 1 of 4 accepted: the floor's 0.25, not below it
    assert seq.spec_stopped_at is None and budget(spec, seq) == K
