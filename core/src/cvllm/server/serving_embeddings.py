"""``POST /v1/embeddings``: OpenAI's embeddings endpoint, over the engine core's embedding requests.

Served where the checkpoint declares a sentence-transformers pooling, or under ``--task embed`` (pooling.py
says which pooling then). All of a request's inputs go to the core as one ``EmbedRequest``; the core runs them
through the prefill path between generation steps (engine/embedding.py) and answers with little-endian float32
bytes, which are the base64 payload as they are, or become the JSON floats.
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from array import array
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from cvllm.engine_process.client import RequestError
from cvllm.pooling import PoolingConfig, check_dimensions, served_pooling
from cvllm.server.errors import APIError, bad_request, from_msgspec
from cvllm.server.lifecycle import run_until_disconnect
from cvllm.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, encode
from cvllm.server.state import ServerState, engine_error

MAX_INPUTS = 2048   # OpenAI's limit of inputs per request
_INPUT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_inputs(state: ServerState, value: str | list[Any]) -> list[list[int]]:
    """The token ids of each input; text is tokenized with the tokenizer's own special-token setting, as
    sentence-transformers does (Qwen3-Embedding's tokenizer appends the end-of-text token it pools)."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(_is_token_id(t) for t in value):
        items = [value]
    else:
        items = value
    if not items:
        raise bad_request("input must not be empty", param="input")
    if len(items) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request, got {len(items)}", param="input")
    if not (all(isinstance(item, str) for item in items) or all(isinstance(item, list) for item in items)):
        raise bad_request(f"input must be {_INPUT_SHAPES}", param="input")
    limit = state.max_model_len
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            state.require_tokenizer("A text input", param="input")
            ids = state.tokenizer.encode(item) if item else []
        elif all(_is_token_id(t) for t in item):
            ids = list(item)
            state.check_token_ids(ids, "input")
        else:
            raise bad_request(f"input must be {_INPUT_SHAPES}", param="input")
        if not ids:
            raise bad_request(f"input {i} is empty" if len(items) > 1 else "input must not be empty", param="input")
        if len(ids) > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, input {i} has "
                              f"{len(ids)} tokens; shorten it.", param="input")
        out.append(ids)
    return out


def float32_values(raw: bytes) -> list[float]:
    """Little-endian float32 bytes as Python floats."""
    values = array("f")
    values.frombytes(raw)
    if sys.byteorder == "big":
        values.byteswap()
    return values.tolist()


class EmbeddingService:
    def __init__(self, state: ServerState):
        self.state = state

    def pooling(self) -> PoolingConfig:
        """The pooling embeddings are served with, or the 400 saying why they are not."""
        state = self.state
        pooling = served_pooling(state.args.task, state.engine().info.pooling)
        if pooling is not None:
            return pooling
        if state.args.task == "generate":
            message = "This server runs with --task generate, which turns /v1/embeddings off."
        else:
            message = ("This model is not served for embeddings: its checkpoint declares no sentence-transformers "
                       "pooling (modules.json and 1_Pooling/config.json). Start cvserve with --task embed to embed "
                       "with the last token's hidden state.")
        raise APIError(400, message, param="model", code="model_not_supported")

    async def __call__(self, http_request: Request, body: bytes) -> Response:
        state = self.state
        try:
            request = msgspec.json.decode(body, type=EmbeddingRequest)
        except msgspec.DecodeError as e:
            error = from_msgspec(e)
            if error.param is None and "missing required field `input`" in str(e):
                error.param = "input"   # msgspec names no path for a top-level field that is missing
            raise error from None
        model = state.check_model(request.model)
        info = state.engine().info
        pooling = self.pooling()
        try:
            check_dimensions(request.dimensions, info.hidden_size, info.matryoshka_dimensions)
        except ValueError as e:
            raise bad_request(str(e), param="dimensions") from None
        inputs = parse_inputs(state, request.input)
        state.check_capacity(1)
        reply = self._reply(inputs, pooling, request.dimensions, request.encoding_format == "base64", model)
        return await run_until_disconnect(http_request, reply)

    async def _reply(self, inputs: list[list[int]], pooling: PoolingConfig, dimensions: int | None, as_base64: bool,
                     model: str) -> Response:
        started = time.perf_counter()
        try:
            vectors = await self.state.engine().embed(f"embd-{uuid.uuid4().hex}", inputs, pooling, dimensions)
        except RequestError as e:
            raise engine_error(e) from None
        data = [EmbeddingData(index=i, embedding=base64.b64encode(raw).decode("ascii") if as_base64
                              else float32_values(raw)) for i, raw in enumerate(vectors)]
        tokens = sum(len(ids) for ids in inputs)
        self.state.metrics.embedded(len(inputs), tokens, time.perf_counter() - started)
        body = EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens,
                                                                              total_tokens=tokens))
        return Response(encode(body), media_type="application/json")
