"""Clients of a running ``cvserve``: ``cvllm chat`` (a terminal chat) and ``cvllm bench`` (a load
generator). They speak plain HTTP + SSE through httpx, the same bytes any OpenAI client sends."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:2000/v1"


def api_url(url: str) -> str:
    """The OpenAI base URL: ``http://host:port`` alone means its ``/v1``."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def server_root(url: str) -> str:
    """Where vLLM's extra routes (/tokenize, /health) live: the base URL without ``/v1``."""
    return api_url(url).removesuffix("/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def sse_events(lines: Iterable[str]) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``.

    Follows the SSE rules a server may lean on: an event ends at a blank line, its ``data:`` lines
    are joined with newlines, one space after the colon is dropped, and other fields and ``:``
    comments are ignored.
    """
    data: list[str] = []
    for line in [*lines, ""]:  # the trailing "" flushes an event the stream did not end with a blank line
        line = line.rstrip("\r")
        if line:
            field, _, value = line.partition(":")
            if field == "data":
                data.append(value.removeprefix(" "))
            continue
        if not data:
            continue
        payload = "\n".join(data)
        data = []
        if payload == "[DONE]":
            return
        yield json.loads(payload)


def error_message(status: int, body: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body, or the body itself."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()[:500] or "(empty response)"
    return f"HTTP {status}: {message}"
