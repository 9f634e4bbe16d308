"""What the supervisor resubmits after an engine core died (no process: the clients are stand-ins): each stream's
request with the tokens its client has, for the completions still running, in the order the requests arrived; a
request in flight through two deaths in a row fails instead when it was alone, and several such are retried one at a
time (the one on trial when a core dies again fails)."""

from __future__ import annotations

import asyncio

import pytest

from cvllm.engine_process.client import EngineDeadError, RequestError, RequestStream, describe_exit
from cvllm.engine_process.messages import AddRequest, SeqDelta
from cvllm.sampling_params import SamplingParams
from cvllm.server.quarantine import Quarantine
from cvllm.server.supervisor import resume_held


class DeadCore:
    def __init__(self, streams: list[RequestStream]):
        self.streams, self.dead = streams, "the engine core exited unexpectedly (exit code -9: killed by SIGKILL)"

    def take_held(self) -> list[RequestStream]:
        streams, self.streams = self.streams, []
        return streams


class NewCore:
    def __init__(self):
        self.sent: list[AddRequest] = []

    def resume(self, stream: RequestStream) -> None:
        self.sent.append(stream.resume_message())
        stream._client = self


def stream(request_id: str, n: int = 1) -> RequestStream:
    return RequestStream(None, request_id, n, [1, 2, 3], SamplingParams(n=n, max_tokens=10))


def test_a_stream_resumes_with_the_tokens_it_was_sent_for_its_unfinished_completions():
    s = stream("r", n=3)
    s._deliver(SeqDelta("r", 0, [7, 8]))
    s._deliver(SeqDelta("r", 1, [9], finish_reason="stop"))
    s._deliver(SeqDelta("r", 2, [4]))
    s._deliver(SeqDelta("r", 0, [5]))
    assert s.resume_message() == AddRequest("r", [1, 2, 3], SamplingParams(n=3, max_tokens=10),
                                            resumed={0: [7, 8, 5], 2: [4]})
    assert stream("fresh").resume_message().resumed is None   # nothing was sent yet: it starts afresh


def test_held_requests_are_resubmitted_in_arrival_order_and_a_poison_request_fails():
    async def scenario():
        streams = [stream(f"r{i}") for i in range(5)]
        streams[2].core_deaths = 1   # it was resumed after an earlier death already
        new = NewCore()
        assert resume_held(DeadCore(streams), new) == 4
        assert [message.request_id for message in new.sent] == ["r0", "r1", "r3", "r4"]
        assert all(s._client is new for i, s in enumerate(streams) if i != 2)
        with pytest.raises(RequestError, match="each time the engine core died, 2 times in a row"):
            await anext(streams[2])

    asyncio.run(scenario())


def test_an_exit_is_described_by_its_code_or_signal():
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9) == "exit code -9: killed by SIGKILL"


class Core(NewCore):
    """A live stand-in core: ``resume`` takes a stream over; ``die`` hands over what it holds, as take_held."""

    def __init__(self):
        super().__init__()
        self.dead, self.streams = None, []

    def resume(self, stream: RequestStream) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        super().resume(stream)
        self.streams.append(stream)

    def finish(self, stream: RequestStream) -> None:
        self.streams.remove(stream)
        stream._deliver(SeqDelta(stream.request_id, 0, [5], finish_reason="length"))

    def die(self) -> DeadCore:
        self.dead = "device error: CUDA error: injected"
        return DeadCore([s for s in self.streams if not s.finished])


def test_suspects_of_two_deaths_are_retried_one_at_a_time_and_the_one_on_trial_at_a_third_death_fails():
    async def scenario():
        a, b, poison, c = (stream(name) for name in ("a", "b", "poison", "c"))
        for s in (a, b, poison):
            s.core_deaths = 1   # in flight at the first death, resumed
        cores = [Core()]
        quarantine = Quarantine(lambda: cores[-1])

        def restart() -> Core:
            dead = cores[-1].die()
            cores.append(Core())
            resume_held(dead, cores[-1], quarantine)
            return cores[-1]

        core = cores[0]
        core.streams = [a, b, poison, c]    # c arrived after the first death: in flight at the second only
        core = restart()
        assert [m.request_id for m in core.sent] == ["c", "a"]   # c resumes; a (arrived first) goes on trial
        assert quarantine.on_trial is a and list(quarantine.waiting) == [b, poison]
        core.finish(a)                      # a bystander: it ends, and the next suspect's trial starts
        assert quarantine.on_trial is b
        core.finish(b)
        assert quarantine.on_trial is poison and not poison.finished
        core = restart()                    # the core dies with the poison request on trial: it alone fails
        # c, beside it at this death and the one before, is a suspect too (the blame went to the one on trial)
        assert [m.request_id for m in core.sent] == ["c"] and c.core_deaths == 2 and quarantine.on_trial is c
        core.finish(c)
        assert not len(quarantine)
        with pytest.raises(RequestError, match="each time the engine core died, 3 times in a row .*as the only"):
            await anext(poison)
        assert a.finished and b.finished and a._error is None and b._error is None

    asyncio.run(scenario())


def test_a_waiting_suspect_whose_client_left_is_dropped_and_the_rest_fail_when_the_server_gives_up():
    async def scenario():
        streams = [stream(f"r{i}") for i in range(3)]
        for s in streams:
            s.core_deaths = 1
        new = Core()
        quarantine = Quarantine(lambda: new)
        resume_held(DeadCore(list(streams)), new, quarantine)
        assert quarantine.on_trial is streams[0] and list(quarantine.waiting) == streams[1:]
        streams[1].abort()                  # its client left while it waited: it never reaches a core
        assert streams[1].finished and list(quarantine.waiting) == [streams[2]]
        new.dead = "gone"
        new.finish(streams[0])              # the next trial cannot start on a dead core: it keeps waiting
        assert quarantine.on_trial is None and list(quarantine.waiting) == [streams[2]]
        quarantine.fail_all(EngineDeadError("the engine core is not running: gave up"))
        with pytest.raises(EngineDeadError, match="gave up"):
            await anext(streams[2])
        assert [m.request_id for m in new.sent] == ["r0"]

    asyncio.run(scenario())
