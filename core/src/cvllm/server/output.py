"""The server's end of the output path: one ``RequestTracker`` per core request, around the shared
``RequestState`` (cvllm/output_processor), plus what both endpoints need to render its updates (logprob text
and bytes, pre-encoded SSE chunks).

Detokenization, stop strings and finish reasons are the output processor's, the same as the offline API's.
The tracker adds what only the server has: the stream of deltas from the engine-core client, the timings, and
aborting the core request when every choice finished early (stop strings) or the client went away, or only the
choices a stop string ended while others go on. Streaming and non-streaming responses are built from the same
updates, so they give the same text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from cvllm.engine_process.messages import TokenLogprobs
from cvllm.output_processor import CompletionState, CompletionUpdate, RequestState
from cvllm.server.protocol import CompletionTokensDetails, PromptTokensDetails, UsageInfo, encode

# OpenAI calls a request's completions "choices"
ChoiceState = CompletionState
ChoiceUpdate = CompletionUpdate

# JSON has no -inf; a token the model rules out gets vLLM's stand-in value instead.
MIN_LOGPROB = -9999.0


class Timer(Protocol):
    def on_tokens(self, count: int, now: float) -> None: ...
    def finished(self, reasons: list[str | None], now: float) -> None: ...


class RequestTracker(RequestState):
    """One core request (n choices): feeds its deltas to the choices, and aborts the request in the core
    when every choice has finished early (stop strings) or when the caller closes it before the end."""

    def __init__(self, stream, choices: list[ChoiceState], prompt_token_ids: list[int], timer: Timer | None = None,
                 arrival: float | None = None):
        super().__init__(choices, prompt_token_ids)
        self.stream = stream
        self.timer = timer
        # time.monotonic() when the request was sent, got its first tokens, and its latest ones (usage timings)
        self.arrival = time.monotonic() if arrival is None else arrival
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self._done = False                 # the core has nothing more for this request
        self._closed = False
        self._siblings = len(choices) > 1  # a stop string ending one choice stops just that one in the core

    async def updates(self) -> AsyncIterator[list[tuple[ChoiceState, ChoiceUpdate]]]:
        try:
            while not self.finished:
                try:
                    deltas = await self.stream.__anext__()
                except StopAsyncIteration:
                    self._done = True
                    break
                batch = self.apply(deltas)
                if self._siblings and not self.finished:
                    self._stop_ended(batch)
                yield batch
            if all(choice.ended_in_core for choice in self.choices):
                self._done = True
        finally:
            self.close()

    def _stop_ended(self, batch: list[tuple[ChoiceState, ChoiceUpdate]]) -> None:
        """Stop in the core the choices a stop string ended in this batch while others go on (the core would
        generate them until the request ends); when every choice has ended, ``close`` aborts the request."""
        first = self.choices[0].index
        ended = [choice.index - first for choice, update in batch
                 if update.finish_reason is not None and not choice.ended_in_core]
        if ended:
            self.stream.abort(ended)

    def on_tokens(self, count: int) -> None:
        now = self.last_token_at = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = now
        if self.timer is not None:
            self.timer.on_tokens(count, now)

    def time_costs_ms(self) -> tuple[int, int]:
        """candle-vllm's (prompt_time_costs, completion_time_costs): arrival → first token and first → last
        token, in whole ms. A prefill is never reported as 0 ms, which its benchmark reads as "not reported"."""
        if self.first_token_at is None or self.last_token_at is None:
            return 0, 0
        return (max(1, round((self.first_token_at - self.arrival) * 1000)),
                round((self.last_token_at - self.first_token_at) * 1000))

    def close(self) -> None:
        """Abort the core request unless it ended by itself (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._done = True
            self.stream.abort()
        if self.timer is not None:
            self.timer.finished([choice.finish_reason for choice in self.choices], time.monotonic())

    async def run_to_end(self) -> None:
        async for _ in self.updates():
            pass


def merged_updates(trackers: list[RequestTracker]) -> AsyncIterator[list[tuple[ChoiceState, ChoiceUpdate]]]:
    """Updates of several core requests (a completions call with several prompts), as they come."""
    if len(trackers) == 1:
        return trackers[0].updates()   # no extra generator to pass through per update (it closes itself)
    return _merged(trackers)


async def _merged(trackers: list[RequestTracker]) -> AsyncIterator[list[tuple[ChoiceState, ChoiceUpdate]]]:
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(tracker: RequestTracker) -> None:
        try:
            async for batch in tracker.updates():
                await queue.put(batch)
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
        finally:
            await queue.put(end)

    tasks = [asyncio.create_task(pump(t)) for t in trackers]
    try:
        remaining = len(tasks)
        while remaining:
            # everything queued meanwhile goes out together: one write for several updates
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            batch, error = [], None
            for item in items:
                if item is end:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    error = error or item
                elif error is None:   # what came before a failure still goes out, as it did one by one
                    batch.extend(item)
            if batch:
                yield batch
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()
        for tracker in trackers:
            tracker.close()


def usage_info(trackers: list[RequestTracker], reasoning_tokens: int = 0) -> UsageInfo:
    """A response's usage over its core requests (a completions call with several prompts has several).
    Their prompts run side by side, so the timings are the slowest request's, not a sum."""
    prompt = sum(t.num_prompt_tokens for t in trackers)
    completion = sum(choice.num_tokens for t in trackers for choice in t.choices)
    prompt_ms, completion_ms = (max(times) for times in zip(*(t.time_costs_ms() for t in trackers)))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(t.num_cached_tokens
                                                                                 for t in trackers)),
                     completion_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning_tokens),
                     prompt_time_costs=prompt_ms, completion_time_costs=completion_ms)


# -- logprob helpers shared by both endpoints ------------------------------------------------------


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def token_text_and_bytes(tokenizer, token_id: int, skip_special_tokens: bool) -> tuple[str, bytes]:
    """The token as shown in logprobs and the bytes it adds to the output text (none for a special token
    that the text leaves out). Part of a UTF-8 character shows as ``bytes:\\xNN``, as OpenAI does. Without a
    tokenizer: ``token_id:N`` (vLLM's ``return_tokens_as_token_ids`` spelling) and no text."""
    if tokenizer is None:
        return f"token_id:{token_id}", b""
    raw = tokenizer.token_bytes(token_id)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    if skip_special_tokens and token_id in tokenizer.special_ids:
        return text, b""
    return text, raw


def top_entries(logprobs: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    return [(tid, clamp_logprob(lp)) for tid, lp in zip(logprobs.top_ids[:k], logprobs.top_logprobs[:k])]


class TextChunks:
    """A reply's SSE events for chunks that carry only text, as the bytes around the text, per choice: the
    rest (id, created, model, index, the nulls) is the same in every such chunk of a choice, so it is encoded
    once, from the real struct, and each chunk costs one string encode and a join instead of building and
    encoding the whole chunk. ``make_chunk(index, text)`` builds the struct; it is used as it is where the
    encoded struct cannot be split around the text."""

    _MARK = "\x00cvllm-text\x00"

    def __init__(self, make_chunk):
        self._make = make_chunk
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}

    def __call__(self, index: int, text: str) -> bytes:
        if index not in self._templates:
            event, mark = sse(encode(self._make(index, self._MARK))), encode(self._MARK)
            self._templates[index] = tuple(event.split(mark)) if event.count(mark) == 1 else None
        template = self._templates[index]
        if template is None:
            return sse(encode(self._make(index, text)))
        return b"".join((template[0], encode(text), template[1]))


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
