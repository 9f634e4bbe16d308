"""``POST /v1/completions``: one or several prompts (text or token ids), each its own core request."""

from __future__ import annotations

import codecs
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from cvllm.engine_process.client import RequestError
from cvllm.engine_process.messages import TokenLogprobs
from cvllm.server.errors import bad_request
from cvllm.server.lifecycle import SSEResponse, mid_stream_error, run_until_disconnect, start_request
from cvllm.server.output import (
    SSE_DONE,
    ChoiceState,
    ChoiceUpdate,
    RequestTracker,
    TextChunks,
    clamp_logprob,
    merged_updates,
    sse,
    token_text_and_bytes,
    top_entries,
    usage_info,
)
from cvllm.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    encode,
)
from cvllm.server.state import ServerState, check_logprobs, engine_error
from cvllm.server.structured import requested_structure

MAX_PROMPTS = 1024
# prompts × n: the sequences one request may queue (the queue limit counts requests, whatever their size)
MAX_CHOICES = 1024
_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_prompts(state: ServerState, prompt: str | list[Any]) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) per prompt; text prompts use the tokenizer's own special-token setting (BOS)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(_is_token_id(t) for t in prompt):
        items = [prompt]
    else:
        items = prompt
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if not (all(isinstance(item, str) for item in items) or all(isinstance(item, list) for item in items)):
        raise bad_request(f"prompt must be {_PROMPT_SHAPES}", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            state.require_tokenizer("A text prompt", param="prompt")
            ids = state.tokenizer.encode(item)
            text = item
        elif isinstance(item, list) and all(_is_token_id(t) for t in item):
            ids, text = list(item), None
            state.check_token_ids(ids, "prompt")
        else:
            raise bad_request(f"prompt must be {_PROMPT_SHAPES}", param="prompt")
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        out.append((text, ids))
    return out


class _ChoiceText:
    """One choice's text and OpenAI legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, state: ChoiceState, prefix: str, num_logprobs: int | None, tokenizer):
        self.state, self.num_logprobs, self.tokenizer = state, num_logprobs, tokenizer
        self.prefix = prefix                    # the echoed prompt, or ""
        self.pieces: list[str] = []
        self.token_ids: list[int] = []          # the ids of the text (return_token_ids)
        self.sent_ids = 0                       # ... already streamed
        self.logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        self.sent = 0                           # logprob entries already streamed
        self._offset = 0                        # characters before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def add_token(self, token_id: int, logprob: float | None, top: dict[str, float] | None,
                  skip_special: bool) -> None:
        text, raw = token_text_and_bytes(self.tokenizer, token_id, skip_special)
        lp = self.logprobs
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(self._offset)
        self._offset += len(self._utf8.decode(raw))

    def add_prompt(self, prompt_ids: list[int], prompt_logprobs: list[TokenLogprobs | None] | None) -> None:
        entries = prompt_logprobs or [None] * len(prompt_ids)
        for token_id, entry in zip(prompt_ids, entries):
            if entry is None:
                self.add_token(token_id, None, None, False)
            else:
                self.add_token(token_id, clamp_logprob(entry.logprob), self._top(token_id, entry), False)

    def _top(self, token_id: int, entry: TokenLogprobs) -> dict[str, float]:
        top = {}
        for top_id, value in top_entries(entry, self.num_logprobs or 0):
            top[token_text_and_bytes(self.tokenizer, top_id, False)[0]] = value
        # like vLLM, the chosen token is always among them
        top.setdefault(token_text_and_bytes(self.tokenizer, token_id, False)[0], clamp_logprob(entry.logprob))
        return top

    def take(self, update: ChoiceUpdate) -> str:
        self.pieces.append(update.text)
        self.token_ids += update.token_ids
        if self.num_logprobs is not None:
            skip = self.state.params.skip_special_tokens
            for token_id, logprobs in update.logprobs:
                self.add_token(token_id, clamp_logprob(logprobs.logprob), self._top(token_id, logprobs), skip)
        return update.text

    def unsent_ids(self) -> list[int]:
        start, self.sent_ids = self.sent_ids, len(self.token_ids)
        return self.token_ids[start:]

    def unsent_logprobs(self) -> CompletionLogprobs | None:
        if self.num_logprobs is None:
            return None
        lp, start = self.logprobs, self.sent
        self.sent = len(lp.tokens)
        return CompletionLogprobs(tokens=lp.tokens[start:], token_logprobs=lp.token_logprobs[start:],
                                  top_logprobs=lp.top_logprobs[start:], text_offset=lp.text_offset[start:])


class CompletionService:
    def __init__(self, state: ServerState):
        self.state = state

    async def __call__(self, http_request: Request, body: bytes) -> Response:
        state = self.state
        request, model = state.parse_request(body, CompletionRequest)
        check_logprobs("logprobs", request.logprobs)
        if request.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise bad_request("best_of other than n is not supported", param="best_of")
        echo = bool(request.echo)
        prompt_logprobs = request.logprobs if echo and request.logprobs is not None else None
        if request.stop:
            state.require_tokenizer("A stop string", param="stop")
        # without a tokenizer the ids are the only output there is
        return_ids = bool(request.return_token_ids) or state.tokenizer is None

        structure = requested_structure(request)
        if structure is not None:
            state.require_tokenizer("Structured output", param="response_format")
        prompts = parse_prompts(state, request.prompt)
        params = []
        for _, ids in prompts:
            max_tokens = state.max_tokens(request.max_tokens, len(ids), chat=False)
            params.append(state.sampling_params(request, max_tokens=max_tokens, logprobs=request.logprobs,
                                                prompt_logprobs=prompt_logprobs, structured_outputs=structure))
        state.check_token_ids(params[0].stop_token_ids, "stop_token_ids")
        n = params[0].n
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices per request (prompts × n), got {len(prompts)} × {n}",
                              param="n")
        state.check_capacity(len(prompts))

        request_id = f"cmpl-{uuid.uuid4().hex}"
        trackers: list[RequestTracker] = []
        try:
            for i, ((_, ids), p) in enumerate(zip(prompts, params)):
                trackers.append(start_request(state, f"{request_id}-{i}", ids, p, first_index=i * n))
        except BaseException:
            for tracker in trackers:
                tracker.close()
            raise
        texts: list[_ChoiceText] = []
        for (text, ids), tracker in zip(prompts, trackers):
            prefix = "" if not echo else text if text is not None else state.tokenizer.decode(
                ids, skip_special_tokens=False) if state.tokenizer is not None else ""
            texts.extend(_ChoiceText(choice, prefix, request.logprobs, state.tokenizer) for choice in tracker.choices)
        reply = _Reply(request_id, int(time.time()), model, trackers, texts, prompts, echo, return_ids)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return SSEResponse(reply.stream(include_usage), trackers)
        return await run_until_disconnect(http_request, reply.complete(), *trackers)


class _Reply:
    def __init__(self, request_id: str, created: int, model: str, trackers: list[RequestTracker],
                 texts: list[_ChoiceText], prompts: list[tuple[str | None, list[int]]], echo: bool, return_ids: bool):
        self.id, self.created, self.model = request_id, created, model
        self.trackers, self.texts = trackers, texts
        self.prompts, self.echoed, self.return_ids = prompts, prompts if echo else None, return_ids
        self.prompt_done = [False] * len(trackers)
        self._text_chunk = TextChunks(lambda index, text: self._chunk_struct(index, text, None, None))

    def usage(self) -> UsageInfo:
        return usage_info(self.trackers)   # the completions API splits off no reasoning: 0 reasoning tokens

    def _echo_prompt(self, choice: ChoiceState) -> None:
        """With echo + logprobs, the prompt's tokens lead the logprobs (they arrive with the first delta)."""
        text = self.texts[choice.index]
        if self.echoed is None or text.num_logprobs is None or text.logprobs.tokens:
            return
        prompt_index = self._prompt_index(choice.index)
        tracker = self.trackers[prompt_index]
        text.add_prompt(self.echoed[prompt_index][1], tracker.prompt_logprobs)

    def _prompt_index(self, index: int) -> int:
        return index // len(self.trackers[0].choices)

    def _ids(self, index: int | None, ids: list[int]) -> dict:
        """return_token_ids' fields of a choice: ``ids``, and the prompt's where ``index`` is given (the whole
        choice, or a stream's first chunk of it)."""
        if not self.return_ids:
            return {}
        fields = {"token_ids": ids}
        if index is not None:
            fields["prompt_token_ids"] = self.prompts[self._prompt_index(index)][1]
        return fields

    async def complete(self) -> Response:
        try:
            async for batch in merged_updates(self.trackers):
                for choice, update in batch:
                    self._echo_prompt(choice)
                    self.texts[choice.index].take(update)
        except RequestError as e:
            raise engine_error(e) from None
        choices = [CompletionChoice(index=t.state.index, text=t.prefix + "".join(t.pieces),
                                    logprobs=t.logprobs if t.num_logprobs is not None else None,
                                    finish_reason=t.state.finish_reason, **self._ids(t.state.index, t.token_ids))
                   for t in self.texts]
        body = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage())
        return Response(encode(body), media_type="application/json")

    def _chunk(self, index: int, text: str, logprobs: CompletionLogprobs | None, finish_reason: str | None,
               ids: dict | None = None) -> bytes:
        if logprobs is None and finish_reason is None and not ids:   # the per-token chunk
            return self._text_chunk(index, text)
        return sse(encode(self._chunk_struct(index, text, logprobs, finish_reason, ids)))

    def _chunk_struct(self, index: int, text: str, logprobs: CompletionLogprobs | None,
                      finish_reason: str | None, ids: dict | None = None) -> CompletionChunk:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
                                  **(ids or {}))
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    async def stream(self, include_usage: bool):
        try:
            started: set[int] = set()
            async for batch in merged_updates(self.trackers):
                # one body write for the whole batch: with the socket write and the ASGI server's work per
                # write, writes are what a streamed token costs the API process most
                out: list[bytes] = []
                for choice, update in batch:
                    text = self.texts[choice.index]
                    first = choice.index not in started
                    if first:
                        started.add(choice.index)
                        self._echo_prompt(choice)
                        piece = text.prefix + text.take(update)
                    else:
                        piece = text.take(update)
                    if piece or (self.return_ids and update.token_ids):
                        ids = self._ids(choice.index if first else None, text.unsent_ids())
                        if first:
                            first = False
                        out.append(self._chunk(choice.index, piece, text.unsent_logprobs(), None, ids))
                    if update.finish_reason is not None:
                        leftover = text.unsent_logprobs()
                        ids = self._ids(choice.index if first else None, text.unsent_ids())
                        out.append(self._chunk(choice.index, "", leftover if leftover and leftover.tokens else None,
                                               update.finish_reason, ids))
                if out:
                    yield b"".join(out)
            if include_usage:
                usage = CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                        usage=self.usage())
                yield sse(encode(usage))
        except Exception as e:  # mid-stream: the status line is gone, so the error travels as an event
            yield sse(mid_stream_error(e, self.id).body())
        finally:
            for tracker in self.trackers:
                tracker.close()
        yield SSE_DONE
