"""One request's stream of deltas in the API process, and the errors that end one.

A stream belongs to whatever holds it now: the core's client (engine_process/client.py), or the server's poison-rule
quarantine while it waits to be retried (server/quarantine.py). Its ``abort`` goes to that holder. It keeps what
resubmitting its request to a new core needs: the prompt, the parameters and every token it was sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Protocol

from cvllm.engine_process.messages import AddRequest, SeqDelta
from cvllm.sampling_params import SamplingParams


class StreamHolder(Protocol):
    def abort(self, request_id: str, indices: Collection[int] | None = None) -> None: ...


class RequestError(RuntimeError):
    """The core failed this request (its step raised, or it was rejected at admission), or died."""

    def __init__(self, message: str, invalid_request: bool = False):
        super().__init__(message)
        self.invalid_request = invalid_request   # rejected at admission: the client's mistake (HTTP 400)


class EngineDeadError(RequestError):
    """The core is gone (crashed, device error, shut down): nothing more can be served."""


class RequestStream:
    """Async iterator over one request's deltas; each ``__anext__`` returns all that are pending."""

    def __init__(self, client: StreamHolder | None, request_id: str, n: int, prompt_token_ids: list[int] | None = None,
                 params: SamplingParams | None = None):
        """``prompt_token_ids`` and ``params``: the request as sent, kept to resubmit it to a new core."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # every token the core sent, by completion index: a new core continues after them if this one dies
        self.outputs: list[list[int]] = [[] for _ in range(n)]
        self.core_deaths = 0   # engine cores that died while this request was in flight (the poison rule)
        self._client = client
        self._unfinished = set(range(n))   # completion indices still generating
        self._pending: list[SeqDelta] = []
        self._waiter: asyncio.Future[None] | None = None
        self._error: RequestError | None = None
        self._ended = False   # nothing more will arrive: all finished, failed, or aborted
        self.on_end: Callable[[], None] | None = None   # called once when it ends (the quarantine's next trial)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> list[SeqDelta]:
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        deltas, self._pending = self._pending, []
        return deltas

    @property
    def finished(self) -> bool:
        return self._ended

    def abort(self, indices: Collection[int] | None = None) -> None:
        """Stop the request in the core, or only its completions ``indices`` (a stop string ended them): the
        stream then ends once the others have finished."""
        self._client.abort(self.request_id, indices)

    # called by the client, in the loop thread

    def resume_message(self) -> AddRequest:
        """The request as a new core takes it over: each unfinished completion with the tokens sent so far."""
        resumed = None
        if any(self.outputs):   # else nothing was streamed yet: it starts afresh (prompt logprobs, cached tokens)
            resumed = {index: self.outputs[index] for index in sorted(self._unfinished)}
        return AddRequest(self.request_id, self.prompt_token_ids, self.params, resumed)

    def _deliver(self, delta: SeqDelta) -> None:
        self._pending.append(delta)
        if delta.token_ids:
            self.outputs[delta.index] += delta.token_ids
        if delta.finish_reason is not None:
            self._unfinished.discard(delta.index)
            if not self._unfinished:
                self._end()
        self._wake()

    def fail(self, error: RequestError) -> None:
        """End the stream with ``error`` (the supervisor's, for a request it will not resume)."""
        self._fail(error)

    def _fail(self, error: RequestError) -> None:
        self._error = error   # deltas already received are still handed out first
        self._end()
        self._wake()

    def _stop(self) -> None:
        self._pending.clear()
        self._end()
        self._wake()

    def _end(self) -> None:
        if not self._ended:
            self._ended = True
            if self.on_end is not None:
                self.on_end()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
