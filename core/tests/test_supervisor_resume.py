"""What the supervisor resubmits after an engine core died (no process: the clients are stand-ins): each stream's
request with the tokens its client has, for the completions still running, in the order the requests arrived; a
request in flight through two deaths in a row fails instead."""

from __future__ import annotations

import asyncio

import pytest

from cvllm.engine_process.client import RequestError, RequestStream, describe_exit
from cvllm.engine_process.messages import AddRequest, SeqDelta
from cvllm.sampling_params import SamplingParams
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
