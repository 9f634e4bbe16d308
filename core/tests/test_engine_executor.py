"""The engine through its seams, with no model: an executor that is not a model runner drives LLMEngine through
the real scheduler (sync and async), step observers get one record per step with the batch's shape (and no record
exists while nobody observes), and the fault injector fails a step the way a failing model would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import cvllm.engine.observers as observers
from cvllm.backends.cpu import CpuBackend
from cvllm.checkpoint.base import Checkpoint
from cvllm.config import ModelConfig
from cvllm.engine.block_manager import BlockManager
from cvllm.engine.build import build_engine
from cvllm.engine.config import EngineConfig
from cvllm.engine.executor import Executor, LaunchedStep
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from cvllm.sampling_params import SamplingParams
from cvllm.testing.faults import FailStepOnPromptToken

VOCAB = 97


def next_token(first: int, position: int) -> int:
    """What the fake model predicts at ``position`` of a sequence whose prompt starts with ``first``."""
    return (first * 7 + position) % VOCAB


class ArithmeticExecutor(Executor):
    """Samples ``next_token`` from what the scheduler tells it (never from host token lists, which lag behind
    under async scheduling), and logs what the engine asked of it."""

    def __init__(self):
        self.batches: list[tuple[int, int, int]] = []   # (seqs, decode rows, prefill tokens) of each execute
        self.records: list = []
        self.previous_in_flight = 0   # executes given a step whose tokens were not read back yet
        self.released: list[int] = []
        self.unread: set[int] = set()   # ids of launched steps whose tokens were not read back yet

    def execute(self, batch: ScheduledBatch, previous: LaunchedStep | None, record=None) -> LaunchedStep:
        self.batches.append((len(batch.seqs), batch.num_decodes, batch.num_prefill_tokens))
        self.records.append(record)
        if previous is not None and id(previous) in self.unread:
            self.previous_in_flight += 1
        sampling = [batch.seqs[i] for i in batch.sample_indices]
        tokens = torch.tensor([next_token(batch.seqs[i].token_ids[0],
                                          batch.seqs[i].num_computed_tokens + batch.num_tokens[i])
                               for i in batch.sample_indices], dtype=torch.long)
        step = LaunchedStep(sampling, tokens, None, False)
        if sampling:
            self.unread.add(id(step))

            def readback():
                self.unread.discard(id(step))
                return [tokens]
            step.readback = readback
        return step

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def make_engine(executor: Executor, async_scheduling: bool, fault_injector=None) -> LLMEngine:
    config = ModelConfig(vocab_size=VOCAB, max_position_embeddings=256, architectures=["Fake"])
    checkpoint = Checkpoint(Path("fake"), config, lambda: iter(()))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256),
                          BlockManager(64, 16, True))
    engine_config = EngineConfig(model=checkpoint, async_scheduling=async_scheduling, fault_injector=fault_injector)
    return LLMEngine(engine_config, checkpoint, CpuBackend(), torch.float32, executor, scheduler)


PROMPTS = {"short": [5, 6, 7], "long": [9] * 40, "mid": [11] * 13}   # "long" takes three chunks of the budget


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return [next_token(prompt[0], len(prompt) + i) for i in range(max_tokens)]


def run_all(engine: LLMEngine, max_tokens: int = 6) -> dict[str, list[int]]:
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens))
    while engine.has_unfinished():
        engine.step()
    return {request_id: seqs[0].output_token_ids for request_id, seqs in engine.requests.items()}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_executor_drives_the_engine_through_the_scheduler(async_scheduling):
    executor = ArithmeticExecutor()
    engine = make_engine(executor, async_scheduling)
    outputs = run_all(engine)
    assert outputs == {request_id: expected(prompt, 6) for request_id, prompt in PROMPTS.items()}
    assert engine.stats.prefill_chunks > 0 and engine.stats.mixed_steps > 0
    assert (engine.stats.overlapped_steps > 0) == async_scheduling
    assert (executor.previous_in_flight > 0) == async_scheduling   # decode rows read the step still in flight
    assert sorted(executor.released) == sorted(s.seq_id for seqs in engine.requests.values() for s in seqs)
    assert engine.scheduler.block_manager.num_free_blocks == 64


class Recorder:
    device_timing = False

    def __init__(self):
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_observers_get_one_record_per_step_with_the_batch_shape(async_scheduling):
    executor = ArithmeticExecutor()
    engine = make_engine(executor, async_scheduling)
    recorder = Recorder()
    steps = 0
    with engine.observers.observing(recorder):
        for request_id, prompt in PROMPTS.items():
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=6))
        while engine.has_unfinished():
            engine.step()
            steps += 1
    records = recorder.records
    assert len(records) == steps and [r.index for r in records] == list(range(steps))
    launched = [r for r in records if r.num_seqs]
    assert [(r.num_seqs, r.num_decodes, r.num_prefill_tokens) for r in launched] == executor.batches
    assert all(r is not None for r in executor.records)   # the executor got each step's record to mark
    mixed = next(r for r in launched if r.mixed)
    assert mixed.num_prefill_tokens > 0 and 0 < mixed.num_decodes < mixed.num_seqs
    decode = launched[-1]
    assert not decode.mixed and decode.num_prefill_tokens == 0 and decode.num_decodes == decode.num_seqs
    assert sum(r.num_outputs for r in records) == engine.stats.generated_tokens == 18
    for r in launched:
        assert {"schedule", "advance"} <= r.host.keys() and r.step_s >= sum(r.host.values()) - 1e-6
        assert r.device == []   # nobody asked for device timing (and the CPU has no events)
    assert any("wait" in r.host and "finish" in r.host for r in records)
    # once the observer is gone, steps build no record again
    engine.add_request("after", [3, 4], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert len(recorder.records) == steps and executor.records[-1] is None


def test_without_observers_no_record_is_built(monkeypatch):
    def no_records(*args, **kwargs):
        raise AssertionError("a step record was built with no observer registered")

    monkeypatch.setattr(observers, "StepRecord", no_records)
    executor = ArithmeticExecutor()
    run_all(make_engine(executor, async_scheduling=True))
    assert executor.records and all(r is None for r in executor.records)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_fault_injector_fails_a_step_and_the_engine_keeps_serving(async_scheduling):
    """What the engine core does with a step that raises (engine_process/process.py: fail the last batch's
    requests, abort them, go on), with the injected failure of the core's tests."""
    executor = ArithmeticExecutor()
    engine = make_engine(executor, async_scheduling, fault_injector=FailStepOnPromptToken(66))
    engine.add_request("early", [8, 9, 10], SamplingParams(max_tokens=12))
    for _ in range(3):
        engine.step()
    engine.add_request("bad", [1, 66, 2], SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="injected step failure"):
        engine.step()
    assert not engine.has_step_in_flight
    failed = sorted({seq.request_id for seq in engine.last_batch.seqs})
    assert failed == ["bad", "early"]
    assert all(seq.num_inflight == 0 for seq in engine.last_batch.seqs)
    for request_id in failed:
        engine.abort_request(request_id)
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == 64
    engine.add_request("after", [20, 21], SamplingParams(max_tokens=5))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests["after"][0].output_token_ids == expected([20, 21], 5)


def test_build_engine_assembles_an_in_process_executor(caplog):
    """build_engine with no model (fake_step_ms): the in-process executor runs FakeModelRunner and the real
    sampler, marks the launch's phases in observed steps, and the start-up line still names every phase."""
    config = ModelConfig(vocab_size=VOCAB, max_position_embeddings=128, architectures=["Fake"], eos_token_id=1)
    checkpoint = Checkpoint(Path("fake"), config, lambda: iter(()))
    with caplog.at_level("INFO", logger="cvllm.engine.build"):
        engine = build_engine(EngineConfig(model=checkpoint, backend="cpu", fake_step_ms=0, num_kv_blocks=32,
                                           max_num_seqs=4), imports_seconds=0.5)
    assert any("engine started in" in m and all(p in m for p in ("imports", "checkpoint", "weights", "KV cache",
                                                                 "graphs")) for m in caplog.messages)
    recorder = Recorder()
    with engine.observers.observing(recorder):
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    assert len(engine.requests["a"][0].output_token_ids) == 3
    assert all({"schedule", "prepare", "forward", "sample", "advance"} <= r.host.keys() for r in recorder.records)
    engine.shutdown()
    assert engine.runner is None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.add_request("b", [5], SamplingParams())


def test_fake_runner_serves_speculative_verify_steps():
    """FakeModelRunner gives a verify step a row per draft too (it measures the stack around a model, n-gram
    speculation included): the engine finishes, and the drafts are scored."""
    config = ModelConfig(vocab_size=VOCAB, max_position_embeddings=256, architectures=["Fake"], eos_token_id=1)
    checkpoint = Checkpoint(Path("fake"), config, lambda: iter(()))
    engine = build_engine(EngineConfig(model=checkpoint, backend="cpu", fake_step_ms=0, num_kv_blocks=64,
                                       max_num_seqs=2, speculative_config={"method": "ngram",
                                                                           "num_speculative_tokens": 3}))
    cycle = engine.runner.token_cycle[:20].tolist()
    engine.add_request("a", cycle * 3, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    while engine.has_unfinished():
        engine.step()
    assert len(engine.requests["a"][0].output_token_ids) == 40
    assert engine.stats.spec_draft_tokens > 0
    engine.shutdown()
