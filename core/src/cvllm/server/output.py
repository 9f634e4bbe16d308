"""From the core's token deltas to text: one ``ChoiceState`` per completion, one ``RequestTracker`` per
core request.

Text is detokenized incrementally; stop strings are found across token boundaries; while a request is
running, the last ``len(longest stop) - 1`` characters are held back, because they could be the start of
a stop string that the next token completes. Streaming and non-streaming responses are built from the
same updates, so they give the same text.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from cvllm.detokenizer import IncrementalDetokenizer
from cvllm.engine.messages import SeqDelta, TokenLogprobs
from cvllm.sampling_params import SamplingParams

# JSON has no -inf; a token the model rules out gets vLLM's stand-in value instead.
MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class TokenEntry:
    """One generated token that belongs to the output, with its logprobs when they were asked for."""
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(slots=True)
class ChoiceUpdate:
    text: str = ""
    tokens: list[TokenEntry] = field(default_factory=list)
    finish_reason: str | None = None       # set on the update that finishes the choice


class ChoiceState:
    def __init__(self, index: int, tokenizer, params: SamplingParams):
        self.index = index                 # the choice's index in the response
        self.tokenizer = tokenizer
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(params.stop), params.skip_special_tokens,
                                                  params.include_stop_str_in_output)
        self.hold_back = max(0, self.detokenizer.longest_stop - 1)
        self.emitted = 0                   # characters of detokenizer.text already handed out
        self.num_tokens = 0                # generated tokens consumed (usage's completion_tokens)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.ended_in_core = False         # the core sent this completion's last token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def add(self, delta: SeqDelta) -> ChoiceUpdate | None:
        """Take one delta from the core; None once this choice has finished (a stop string matched)."""
        if self.finished:
            return None
        update = ChoiceUpdate()
        last = len(delta.token_ids) - 1
        for i, token_id in enumerate(delta.token_ids):
            self.num_tokens += 1
            logprobs = delta.logprobs[i] if delta.logprobs is not None and i < len(delta.logprobs) else None
            # The core ends with "stop" only on an EOS or stop_token_ids token: like vLLM, that token is not
            # part of the text unless include_stop_str_in_output.
            if i == last and delta.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                break
            update.tokens.append(TokenEntry(token_id, logprobs))
            matched = self.detokenizer.update(token_id)
            if matched is not None:
                self.finish_reason, self.stop_reason = "stop", matched
                break
        self.ended_in_core = delta.finish_reason is not None
        if not self.finished and delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
        update.text = self._release()
        update.finish_reason = self.finish_reason
        return update

    def _release(self) -> str:
        text = self.detokenizer.text
        end = len(text) if self.finished else max(self.emitted, len(text) - self.hold_back)
        piece, self.emitted = text[self.emitted:end], end
        return piece


class Timer(Protocol):
    def on_tokens(self, count: int, now: float) -> None: ...
    def finished(self, reasons: list[str | None], now: float) -> None: ...


class RequestTracker:
    """One core request (n choices): feeds its deltas to the choices, and aborts the request in the core
    when every choice has finished early (stop strings) or when the caller closes it before the end."""

    def __init__(self, stream, choices: list[ChoiceState], num_prompt_tokens: int, timer: Timer | None = None):
        self.stream = stream
        self.choices = choices
        self.num_prompt_tokens = num_prompt_tokens
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.timer = timer
        self._done = False                 # the core has nothing more for this request
        self._closed = False

    @property
    def finished(self) -> bool:
        return all(choice.finished for choice in self.choices)

    async def updates(self) -> AsyncIterator[list[tuple[ChoiceState, ChoiceUpdate]]]:
        try:
            while not self.finished:
                try:
                    deltas = await self.stream.__anext__()
                except StopAsyncIteration:
                    self._done = True
                    break
                yield self._apply(deltas)
            if all(choice.ended_in_core for choice in self.choices):
                self._done = True
        finally:
            self.close()

    def _apply(self, deltas: list[SeqDelta]) -> list[tuple[ChoiceState, ChoiceUpdate]]:
        out = []
        new_tokens = 0
        for delta in deltas:
            if delta.prompt_logprobs is not None:
                self.prompt_logprobs = delta.prompt_logprobs
            new_tokens += len(delta.token_ids)
            if not 0 <= delta.index < len(self.choices):
                continue
            choice = self.choices[delta.index]
            update = choice.add(delta)
            if update is not None:
                out.append((choice, update))
        if self.timer is not None and new_tokens:
            self.timer.on_tokens(new_tokens, time.monotonic())
        return out

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


async def merged_updates(trackers: list[RequestTracker]) -> AsyncIterator[list[tuple[ChoiceState, ChoiceUpdate]]]:
    """Updates of several core requests (a completions call with several prompts), as they come."""
    if len(trackers) == 1:
        try:
            async for batch in trackers[0].updates():
                yield batch
        finally:
            trackers[0].close()
        return
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
            item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for tracker in trackers:
            tracker.close()


# -- logprob helpers shared by both endpoints ------------------------------------------------------


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


def token_text_and_bytes(tokenizer, token_id: int, skip_special_tokens: bool) -> tuple[str, bytes]:
    """The token as shown in logprobs and the bytes it adds to the output text (none for a special token
    that the text leaves out). Part of a UTF-8 character shows as ``bytes:\\xNN``, as OpenAI does."""
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


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
