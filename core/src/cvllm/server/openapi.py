"""``/openapi.json``: the request and response schemas, generated from the msgspec Structs, so schema-driven
fuzzers and client generators see exactly what the server decodes."""

from __future__ import annotations

from typing import Any

import msgspec

from cvllm.server import protocol as p

REF = "#/components/schemas/{name}"

# (path, method, summary, request body type or None, response type or None, response media type)
OPERATIONS: list[tuple[str, str, str, type | None, type | None, str]] = [
    ("/v1/chat/completions", "post", "Chat completion (JSON, or SSE with stream=true)", p.ChatCompletionRequest,
     p.ChatCompletionResponse, "application/json"),
    ("/v1/completions", "post", "Text completion (JSON, or SSE with stream=true)", p.CompletionRequest,
     p.CompletionResponse, "application/json"),
    ("/v1/embeddings", "post", "Embeddings (where the model declares a pooling, or --task embed)",
     p.EmbeddingRequest, p.EmbeddingResponse, "application/json"),
    ("/v1/models", "get", "Served models", None, p.ModelList, "application/json"),
    ("/tokenize", "post", "Tokenize a prompt or a chat", p.TokenizeRequest, p.TokenizeResponse, "application/json"),
    ("/detokenize", "post", "Token ids to text", p.DetokenizeRequest, p.DetokenizeResponse, "application/json"),
    ("/tokenizer_info", "get", "Special tokens and the chat template", None, p.TokenizerInfo, "application/json"),
    ("/health", "get", "200 when ready, 503 while loading or after the engine died", None, None, ""),
    ("/metrics", "get", "Prometheus metrics", None, None, "text/plain"),
]

ERROR_STATUSES = {"400": "Bad request", "401": "Missing or wrong API key", "404": "Unknown model or route",
                  "413": "Body too large", "429": "Queue full", "500": "Internal error", "503": "Not ready"}


def openapi_document(version: str) -> dict[str, Any]:
    types = [t for op in OPERATIONS for t in (op[3], op[4]) if t is not None]
    types += [p.ChatCompletionChunk, p.ErrorResponse]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    by_type = dict(zip(types, schemas))
    error_ref = by_type[p.ErrorResponse]
    paths: dict[str, Any] = {}
    for path, method, summary, request_type, response_type, media in OPERATIONS:
        ok: dict[str, Any] = {"description": "OK"}
        if response_type is not None:
            ok["content"] = {media: {"schema": by_type[response_type]}}
        elif media:
            ok["content"] = {media: {"schema": {"type": "string"}}}
        responses = {"200": ok}
        if request_type is not None:
            responses.update({code: {"description": text, "content": {"application/json": {"schema": error_ref}}}
                              for code, text in ERROR_STATUSES.items()})
        operation: dict[str, Any] = {"summary": summary, "responses": responses}
        if request_type is not None:
            operation["requestBody"] = {"required": True,
                                        "content": {"application/json": {"schema": by_type[request_type]}}}
        paths[path] = {method: operation}
    return {
        "openapi": "3.1.0",
        "info": {"title": "cvllm OpenAI-compatible API", "version": version},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
