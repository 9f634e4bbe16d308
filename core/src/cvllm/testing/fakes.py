"""For tests only: the server's HTTP app without a model or an engine core, and the engine core without the API.

``FakeClient`` stands in for the engine-core client and plays back scripted token ids, so a test can send a
request through the real app (httpx's ASGI transport, no threads, no sockets) and check the exact text, SSE
chunks and prompt the server produced. ``ScriptedChannel`` stands in for the core's pipes, so a test can drive
``EngineCore.run`` with a list of commands and read what it sent. Shared here because test packages never import
each other's tests.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque

import httpx

from cvllm.engine.config import EngineConfig
from cvllm.engine_process.messages import CoreStats, Ready, SeqDelta, TokenLogprobs
from cvllm.sampling_params import SamplingParams
from cvllm.server.app import build_app
from cvllm.server.args import ServerArgs
from cvllm.server.reasoning import detect
from cvllm.server.state import ServerState
from cvllm.testing import CHATML_TEMPLATE

HI = [{"role": "user", "content": "hi"}]


class FakeStream:
    """One request's deltas, batch by batch; ``fail`` is raised once they run out (an engine failure)."""

    def __init__(self, batches: list[list[SeqDelta]], fail: Exception | None):
        self.batches, self.fail, self.aborts = deque(batches), fail, 0
        self.stopped: list[list[int]] = []   # each abort of some completions only (a stop string ended them)

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[SeqDelta]:
        await asyncio.sleep(0)
        if not self.batches:
            if self.fail is not None:
                raise self.fail
            raise StopAsyncIteration
        return self.batches.popleft()

    def abort(self, indices=None) -> None:
        if indices is None:
            self.aborts += 1
        else:
            self.stopped.append(list(indices))


class FakeClient:
    """Plays back ``outputs[i]`` (token ids) as choice i, one token per choice per step; the last token of
    each choice carries ``finish``. Records every request's prompt ids and sampling params."""

    def __init__(self, outputs: list[list[int]], finish: str | None = "length", fail: Exception | None = None):
        self.outputs, self.finish, self.fail = outputs, finish, fail
        self.info = Ready(max_model_len=256, num_kv_blocks=64, block_size=16, backend="fake", dtype="float32",
                          max_num_seqs=4, vocab_size=512)
        self.stats, self.dead, self.num_in_flight = CoreStats(), None, 0
        self.streams: list[FakeStream] = []
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> FakeStream:
        self.prompts.append(prompt_ids)
        self.params.append(params)
        batches = []
        for step in range(max(len(o) for o in self.outputs[:params.n])):
            batch = []
            for index, tokens in enumerate(self.outputs[:params.n]):
                if step < len(tokens):
                    last = step == len(tokens) - 1
                    logprobs = None
                    if params.logprobs is not None:
                        logprobs = [TokenLogprobs(-0.25, [tokens[step]], [-0.25])]
                    batch.append(SeqDelta(request_id, index, [tokens[step]], logprobs,
                                          self.finish if last else None, num_prompt_tokens=len(prompt_ids)))
            batches.append(batch)
        stream = FakeStream(batches, self.fail)
        self.streams.append(stream)
        return stream


def make_state(tokenizer, client: FakeClient | None, template: str = CHATML_TEMPLATE,
               reasoning_parser: str | None = None) -> ServerState:
    """A ServerState around ``tokenizer`` (a cvllm Tokenizer) and ``client`` (None: still loading); the
    reasoning parser is the given one, else the one detected from ``template``."""
    args = ServerArgs(engine=EngineConfig(model="fake"), reasoning_parser=reasoning_parser)
    parser = reasoning_parser or detect(template, lambda: tokenizer.apply_chat_template(HI, chat_template=template))
    state = ServerState(args, tokenizer, "fake", ["fake"], template, {}, parser)
    state.client = client
    return state


def call(state: ServerState, method: str, path: str, body: dict | None = None) -> httpx.Response:
    """One HTTP request to the app built from ``state``, run to completion (a streamed body is read whole)."""
    async def run():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, json=body)
    return asyncio.run(run())


def sse_chunks(response: httpx.Response) -> list[dict]:
    """The JSON chunks of an SSE response, checked to end with exactly one ``data: [DONE]``."""
    events = [e for e in response.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


class ScriptedChannel:
    """The engine core's pipes (engine_process.CoreChannel) as lists: the commands handed out in order, the messages
    it sent; EOF once the commands run out (as when the API process goes away)."""

    def __init__(self, commands):
        self.commands, self.sent = list(commands), []

    def recv(self):
        if not self.commands:
            raise EOFError
        return self.commands.pop(0)

    def pending(self) -> bool:
        return bool(self.commands)

    def send(self, message) -> None:
        self.sent.append(message)

    send_quietly = send
