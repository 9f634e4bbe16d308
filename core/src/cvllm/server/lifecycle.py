"""A request's life around the core: start it, stop it when the client leaves, report failures."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from cvllm.engine_process.client import RequestError
from cvllm.sampling_params import SamplingParams
from cvllm.server.errors import APIError
from cvllm.server.output import SSE_HEADERS, ChoiceState, RequestTracker
from cvllm.server.state import ServerState, engine_error

logger = logging.getLogger("cvllm.server")


def start_request(state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  first_index: int = 0) -> RequestTracker:
    """Send one request to the core; its choices get response indices first_index .. first_index + n - 1."""
    client = state.engine()
    arrival = time.monotonic()
    try:
        stream = client.add_request(request_id, prompt_ids, params)
    except RequestError as e:
        raise engine_error(e) from None
    timer = state.metrics.timer(arrival, len(prompt_ids))
    choices = [ChoiceState(first_index + i, state.tokenizer, params) for i in range(params.n)]
    faults = state.args.engine.fault_injector
    if hasattr(faults, "wrap_choices"):   # a test's fault plan reaching detokenization (cvllm.testing.faults)
        faults.wrap_choices(prompt_ids, choices)
    return RequestTracker(stream, choices, prompt_ids, timer, arrival)


async def run_until_disconnect(http_request: Request, work: Awaitable[Response],
                               *trackers: RequestTracker) -> Response:
    """Await a non-streaming response, abandoning it (and aborting its requests in the core) if the
    client goes away first: nobody would read the answer, and its KV blocks are wanted elsewhere."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(http_request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        for tracker in trackers:
            tracker.close()
        return Response(status_code=499)   # nobody is listening; the server just needs to return something
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            for tracker in trackers:
                tracker.close()


class SSEResponse(StreamingResponse):
    """An event stream that closes its trackers however it ends: finished, failed, or cancelled because the
    client left, even before the body generator ran once (then its own ``finally`` never runs)."""

    def __init__(self, content, trackers: list[RequestTracker]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.trackers = trackers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for tracker in self.trackers:
                tracker.close()


async def _disconnected(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def mid_stream_error(error: Exception, request_id: str) -> APIError:
    """The error event for a failure after the stream started (the status line is already sent)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, RequestError):
        return engine_error(error)
    logger.error("request %s failed mid-stream", request_id, exc_info=error)
    return APIError(500, f"Internal server error (request id {request_id})")
