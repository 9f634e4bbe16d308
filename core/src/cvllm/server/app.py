"""The Starlette application: routes, API-key check, CORS, body limit, and OpenAI-shaped errors for
everything that goes wrong (Starlette's own 404/405 included)."""

from __future__ import annotations

import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable

import msgspec
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from cvllm import __version__
from cvllm.server.errors import APIError, bad_request, from_msgspec
from cvllm.server.metrics import CONTENT_TYPE
from cvllm.server.openapi import openapi_document
from cvllm.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    encode,
)
from cvllm.server.serving_chat import ChatService, render_prompt
from cvllm.server.serving_completions import CompletionService
from cvllm.server.serving_embeddings import EmbeddingService
from cvllm.server.state import ServerState
from cvllm.server.ui import is_open_path, ui_origins, ui_routes

logger = logging.getLogger("cvllm.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})

Handler = Callable[[Request], Awaitable[Response]]


def json_response(value: object, status: int = 200) -> Response:
    return Response(encode(value), status_code=status, media_type="application/json")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it grows past ``limit`` (not after reading it all)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"The request body is larger than the limit of {limit} bytes.")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"The request body is larger than the limit of {limit} bytes.")
        chunks.append(chunk)
    return b"".join(chunks)


def endpoint(handler: Handler) -> Handler:
    """APIError → its JSON; anything else → a 500 with a request id, the traceback only in the log."""
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception:
            error_id = uuid.uuid4().hex[:12]
            logger.exception("unexpected error while serving %s %s (error id %s)", request.method,
                             request.url.path, error_id)
            return APIError(500, f"Internal server error (error id {error_id}).").response()
    return wrapped


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every route but health and metrics, the chat page when it is served
    (it asks the user for the key), and CORS preflights."""

    def __init__(self, app: ASGIApp, api_key: str, open_page: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_page = open_page

    def is_open(self, path: str) -> bool:
        return path in OPEN_PATHS or (self.open_page and is_open_path(path))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and not self.is_open(scope["path"]):
            given = (Headers(scope=scope).get("authorization") or "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                                 headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> Starlette:
    args = state.args
    chat, completions = ChatService(state), CompletionService(state)
    embed = EmbeddingService(state)

    async def chat_completions(request: Request) -> Response:
        return await chat(request, await read_body(request, args.max_body_bytes))

    async def text_completions(request: Request) -> Response:
        return await completions(request, await read_body(request, args.max_body_bytes))

    async def embeddings(request: Request) -> Response:
        return await embed(request, await read_body(request, args.max_body_bytes))

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=state.created, root=state.model_path, max_model_len=state.max_model_len)

    async def list_models(request: Request) -> Response:
        state.engine()
        return json_response(ModelList(data=[card(name) for name in state.model_names]))

    async def get_model(request: Request) -> Response:
        state.engine()
        # a lookup of one model card by its id: only the served names have one
        return json_response(card(state.check_model(request.path_params["model_id"], strict=True)))

    async def health(request: Request) -> Response:
        if state.ready:
            return Response(status_code=200)
        state.engine()   # raises the 503 that says why
        return Response(status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def version(request: Request) -> Response:
        return json_response({"version": __version__})

    async def tokenize(request: Request) -> Response:
        body = _decode(await read_body(request, args.max_body_bytes), TokenizeRequest)
        state.check_model(body.model)
        state.require_tokenizer("Tokenizing")
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            text = render_prompt(state, body.messages, add_generation_prompt=body.add_generation_prompt,
                                 continue_final_message=body.continue_final_message, tools=body.tools,
                                 chat_template_kwargs=body.chat_template_kwargs)
            ids = state.tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=add_special)
        strs = None
        if body.return_token_strs:
            strs = [state.tokenizer.tokenizer.id_to_token(i) or "" for i in ids]
        return json_response(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                              token_strs=strs))

    async def detokenize(request: Request) -> Response:
        body = _decode(await read_body(request, args.max_body_bytes), DetokenizeRequest)
        state.check_model(body.model)
        state.require_tokenizer("Detokenizing")
        state.check_token_ids(body.tokens, "tokens")
        return json_response(DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens,
                                                                               skip_special_tokens=False)))

    async def tokenizer_info(request: Request) -> Response:
        state.require_tokenizer("tokenizer_info")
        tok = state.tokenizer
        probe = tok.encode("a", add_special_tokens=True)
        return json_response(TokenizerInfo(
            model_max_length=state.max_model_len, vocab_size=tok.vocab_size, bos_token=tok.bos_token,
            eos_token=tok.eos_token, pad_token=tok.pad_token, bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.token_to_id(tok.pad_token),
            add_bos_token=bool(probe) and tok.bos_token_id is not None and probe[0] == tok.bos_token_id,
            chat_template=state.chat_template))

    schema = encode(openapi_document(__version__))

    async def openapi(request: Request) -> Response:
        return Response(schema, media_type="application/json")

    routes: list[tuple[str, Handler, list[str]]] = [
        ("/v1/chat/completions", chat_completions, ["POST"]),
        ("/v1/completions", text_completions, ["POST"]),
        ("/v1/embeddings", embeddings, ["POST"]),
        ("/v1/models", list_models, ["GET"]),
        ("/v1/models/{model_id:path}", get_model, ["GET"]),
        ("/health", health, ["GET"]),
        ("/ping", health, ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/version", version, ["GET"]),
        ("/tokenize", tokenize, ["POST"]),
        ("/detokenize", detokenize, ["POST"]),
        ("/tokenizer_info", tokenizer_info, ["GET"]),
        ("/openapi.json", openapi, ["GET"]),
    ]
    table = []
    for path, handler, methods in routes:
        table.append(Route(path, endpoint(handler), methods=methods))
        if path.startswith("/v1/"):
            table.append(Route(path[3:], endpoint(handler), methods=methods))
        elif path in ("/tokenize", "/detokenize", "/tokenizer_info"):
            table.append(Route("/v1" + path, endpoint(handler), methods=methods))

    page_here = args.ui and args.ui_port is None
    if page_here:
        table.extend(ui_routes(api_port=None, api_key_required=bool(args.api_key)))
    origins, origin_regex = list(args.cors_allow_origins), None
    if args.ui and args.ui_port is not None:   # the page on its own port calls this one from its origin
        page_origins, origin_regex = ui_origins(args.host, args.ui_port)
        origins += [origin for origin in page_origins if origin not in origins]
    middleware = []
    if origins or origin_regex:
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins, allow_origin_regex=origin_regex,
                                     allow_credentials=args.cors_allow_credentials,
                                     allow_methods=args.cors_allow_methods, allow_headers=args.cors_allow_headers))
    if args.api_key:
        middleware.append(Middleware(APIKeyMiddleware, api_key=args.api_key, open_page=page_here))
    return Starlette(routes=table, middleware=middleware,
                     exception_handlers={HTTPException: _http_error, Exception: _unexpected_error})


def _decode(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:
        raise from_msgspec(e) from None


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the OpenAI shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"No route {request.method} {request.url.path}."
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed on {request.url.path}."
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    error_id = uuid.uuid4().hex[:12]
    logger.error("unexpected error (error id %s)", error_id, exc_info=exc)
    return APIError(500, f"Internal server error (error id {error_id}).").response()
