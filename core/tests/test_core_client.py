"""Engine-core client and core-process pieces that need no model (the end-to-end tests, which need a
model plugin, are in plugins/models-llama/tests/test_core_process.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from types import SimpleNamespace

import msgspec
import pytest

from cvllm.engine.config import EngineConfig
from cvllm.engine.errors import EngineBrokenError
from cvllm.engine.executor import Executor
from cvllm.engine.scheduler import EngineStats
from cvllm.engine_process.client import (
    EngineCoreClient,
    EngineStartupError,
    RequestError,
    RequestStream,
)
from cvllm.engine_process.deltas import token_logprobs
from cvllm.engine_process.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    RequestFailed,
    SeqDelta,
    StepOutputs,
    ToCore,
)
from cvllm.engine_process.process import CoreChannel, EngineCore, describe, is_device_error
from cvllm.outputs import Logprob
from cvllm.sampling_params import SamplingParams
from cvllm.testing.fakes import ScriptedChannel
from cvllm.testing.plugins import registers


def test_startup_failure_raises_with_the_cores_message(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")   # a directory, but no config.json

    async def start():
        await EngineCoreClient.start(EngineConfig(model=str(tmp_path), dtype="float32"), startup_timeout=60)

    with pytest.raises(EngineStartupError, match="missing config.json"):
        asyncio.run(start())


class ExitsWhenUnpickled:
    """Kills the spawned child while it unpickles its arguments: a core that dies before saying anything."""

    def __reduce__(self):
        return os._exit, (3,)


def test_a_core_that_exits_silently_during_startup_reports_its_exit_code():
    async def start():
        await EngineCoreClient.start(EngineConfig(model=ExitsWhenUnpickled()), startup_timeout=60)

    with pytest.raises(EngineStartupError, match=r"exited during start-up \(exit code 3\)"):
        asyncio.run(start())


def test_sampling_params_survive_the_trip_to_the_core(only_builtin_plugins, add_plugin):
    add_plugin(registers("register_samplers", ("upper", "x:Upper")), "procs")
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, max_tokens=None, stop=["</s>", "\n\n"],
                            stop_token_ids=[7, 9], seed=2**64 - 1, logprobs=2, prompt_logprobs=0,
                            repetition_penalty=1.1, presence_penalty=-0.5, frequency_penalty=0.25, min_p=0.05,
                            min_tokens=2, ignore_eos=True, skip_special_tokens=False, include_stop_str_in_output=True,
                            logit_bias={5: -100.0, 2**31 - 1: 2.5}, logits_processors=["upper", "upper"])
    wire = msgspec.msgpack.encode(AddRequest("r", [1, 2, 3], params))
    command = msgspec.msgpack.decode(wire, type=ToCore)
    assert isinstance(command, AddRequest) and command.prompt_token_ids == [1, 2, 3]
    assert type(command.params) is SamplingParams and command.params == params   # a Struct both ways, no dict
    assert msgspec.msgpack.decode(wire)["params"]["logits_processors"] == ["upper", "upper"]
    defaults = msgspec.msgpack.encode(AddRequest("r", [1], SamplingParams()))
    assert msgspec.msgpack.decode(defaults, type=ToCore).params == SamplingParams()
    assert len(defaults) < len(wire) // 3   # the defaults are left out


def test_parameters_the_core_rejects_fail_only_their_request():
    """The API process validated them with the same rules; should the core still reject them (a plugin loaded in
    one process only), the request fails as a client error and the core reads on."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    channel = CoreChannel(reader, None)
    bad = {"type": "AddRequest", "request_id": "bad", "prompt_token_ids": [1], "params": {"top_p": 7.0}}
    writer.send_bytes(msgspec.msgpack.encode(bad))
    writer.send_bytes(msgspec.msgpack.encode(AddRequest("good", [1], SamplingParams(top_p=0.5))))
    failed = channel.recv()
    assert isinstance(failed, RequestFailed) and failed.request_ids == ["bad"] and failed.invalid_request
    assert "top_p must be in (0, 1]" in failed.message
    assert channel.recv() == AddRequest("good", [1], SamplingParams(top_p=0.5))
    writer.send_bytes(msgspec.msgpack.encode({"type": "AbortRequests", "request_ids": "not a list"}))
    with pytest.raises(msgspec.ValidationError):   # not a request: the protocol itself is broken
        channel.recv()
    core = EngineCore(EngineWhoseStepRaises(ValueError("unused")), ScriptedChannel([failed]))
    with pytest.raises(EOFError):
        core.run()
    assert core.channel.sent[0] is failed   # sent on to the API process as it is


def test_token_logprobs_are_sent_in_rank_order_with_the_chosen_token():
    entry = {9: Logprob(-2.0, 2), 4: Logprob(-0.5, 1), 30: Logprob(-6.0, None), 17: Logprob(-2.5, 3)}
    sent = token_logprobs(entry, 30)   # sampled outside the top-k: only its logprob travels
    assert (sent.logprob, sent.top_ids, sent.top_logprobs) == (-6.0, [4, 9, 17], [-0.5, -2.0, -2.5])
    inside = token_logprobs(entry, 9)
    assert inside.logprob == -2.0 and inside.top_ids == [4, 9, 17]
    assert token_logprobs({5: Logprob(-0.1, None)}, 5).top_ids == []   # logprobs=0


def test_device_errors_are_told_apart_from_step_errors():
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_device_error(RuntimeError("shape mismatch"))
    assert not is_device_error(ValueError("bad"))
    assert describe(ValueError("prompt too long")) == "prompt too long"
    assert describe(KeyError("x")) == "KeyError: 'x'"
    assert describe(AssertionError()) == "AssertionError"


def delta(index: int, tokens: list[int], finish: str | None = None) -> SeqDelta:
    return SeqDelta("r", index, tokens, finish_reason=finish)


def test_a_stream_merges_pending_deltas_and_ends_after_all_n_completions():
    async def scenario():
        stream = RequestStream(client=None, request_id="r", n=2)
        stream._deliver(delta(0, [1]))
        stream._deliver(delta(1, [2]))
        stream._deliver(delta(0, [3], "length"))
        merged = await stream.__anext__()          # a lagging consumer gets all three at once
        assert [(d.index, d.token_ids) for d in merged] == [(0, [1]), (1, [2]), (0, [3])]
        assert not stream.finished
        waiting = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        assert not waiting.done()                  # nothing pending: it waits for the next delta
        stream._deliver(delta(1, [4], "stop"))
        assert [d.token_ids for d in await waiting] == [[4]]
        assert stream.finished
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()

    asyncio.run(scenario())


def test_a_failed_stream_hands_out_what_arrived_then_raises_and_a_stopped_one_drops_it():
    async def scenario():
        failed = RequestStream(client=None, request_id="r", n=1)
        failed._deliver(delta(0, [1]))
        failed._fail(RequestError("step failed"))
        assert [d.token_ids for d in await failed.__anext__()] == [[1]]
        with pytest.raises(RequestError, match="step failed"):
            await failed.__anext__()

        stopped = RequestStream(client=None, request_id="s", n=1)
        stopped._deliver(delta(0, [1]))
        waiting = asyncio.ensure_future(stopped.__anext__())
        await asyncio.sleep(0)
        stopped._stop()                            # aborted: pending deltas are dropped
        assert [d.token_ids for d in await waiting] == [[1]]   # (already delivered before the abort)
        with pytest.raises(StopAsyncIteration):
            await stopped.__anext__()

    asyncio.run(scenario())


class EngineWhoseStepRaises:
    """Just enough of LLMEngine for the core loop; ``step`` schedules the request, then raises."""

    def __init__(self, error: Exception):
        self.error = error
        self.requests: dict[str, list] = {}
        self.scheduler = SimpleNamespace(schedule=self._schedule, running=[], waiting=[], stats=EngineStats(),
                                         block_manager=SimpleNamespace(num_blocks=4, num_free_blocks=4))
        self.executor = Executor()   # the interface's defaults: no worker processes to watch

    def _schedule(self):
        return SimpleNamespace(seqs=[seq for seqs in self.requests.values() for seq in seqs])

    def add_request(self, request_id, prompt_token_ids, params):
        self.requests[request_id] = [SimpleNamespace(request_id=request_id, seq_id=len(self.requests))]

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self):
        self.scheduler.schedule()
        raise self.error


def add(request_id: str) -> AddRequest:
    return AddRequest(request_id, [1, 2], SamplingParams())


def test_a_step_error_fails_the_steps_requests_and_the_loop_goes_on():
    channel = ScriptedChannel([add("x"), add("y")])
    core = EngineCore(EngineWhoseStepRaises(ValueError("bad shapes")), channel)
    with pytest.raises(EOFError):   # it went back to waiting for commands: the script's end
        core.run()
    failed, idle = channel.sent   # then, before blocking, a snapshot of the idle state
    assert failed == RequestFailed(["x", "y"], "bad shapes")
    assert isinstance(idle, StepOutputs) and idle.deltas == [] and idle.stats.kv_blocks_free == 4


def test_a_device_error_ends_the_core_with_core_dead():
    channel = ScriptedChannel([add("x")])
    error = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert EngineCore(EngineWhoseStepRaises(error), channel).run() == 1
    assert channel.sent == [CoreDead("device error: CUDA error: an illegal memory access was encountered")]


WORKER_DIED = "tensor-parallel worker 1 (pid 7, killed by SIGKILL) died; the engine cannot run steps any more"


def test_a_broken_engine_ends_the_core_with_core_dead():
    """A worker that died or hung mid-step: not one step's failure, since every later step would fail too."""
    channel = ScriptedChannel([add("x")])
    assert EngineCore(EngineWhoseStepRaises(EngineBrokenError(WORKER_DIED)), channel).run() == 1
    assert channel.sent == [CoreDead(WORKER_DIED)]


def test_a_worker_that_ends_while_the_core_is_idle_ends_the_core():
    """The idle core waits on its command pipe and the workers' sentinels: /health need not wait for a request."""
    sentinel, worker_end = multiprocessing.Pipe(duplex=False)   # readable (EOF) once the "worker" end closes

    def check():
        raise EngineBrokenError(WORKER_DIED)

    engine = EngineWhoseStepRaises(ValueError("unused"))
    engine.executor = SimpleNamespace(sentinels=lambda: [sentinel.fileno()], check=check)
    commands, _api_end = multiprocessing.Pipe(duplex=False)   # open, and nothing is ever sent
    channel = CoreChannel(commands, None)
    channel.sent = []
    channel.send_quietly = channel.sent.append
    worker_end.close()
    assert EngineCore(engine, channel).run() == 1
    assert channel.sent == [CoreDead(WORKER_DIED)]


def test_an_abort_names_whole_requests_unless_it_carries_completion_indices():
    decoder = msgspec.msgpack.Decoder(ToCore)
    # as a sender without the field writes it: the whole request
    old = msgspec.msgpack.encode({"type": "AbortRequests", "request_ids": ["x"]})
    assert decoder.decode(old) == AbortRequests(["x"]) and AbortRequests(["x"]).indices is None
    some = decoder.decode(msgspec.msgpack.Encoder().encode(AbortRequests(["x"], [1])))
    assert some == AbortRequests(["x"], [1])


def test_no_exit_hook_is_left_per_launch(tmp_path):
    """Each launch is ended at exit while it runs, and forgotten once it has ended (no hook or Process kept per
    launch for the life of the API process)."""
    from cvllm.engine_process import client as client_module

    config = EngineConfig(model=str(tmp_path / "missing"), fake_step_ms=1.0)
    before = set(client_module._live_cores)
    launch = EngineCoreClient.launch(config)
    assert launch.process in client_module._live_cores
    with pytest.raises(EngineStartupError):
        asyncio.run(launch.ready(60))
    assert client_module._live_cores == before
