"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import re

import msgspec
from starlette.responses import Response

from cvllm.server.protocol import ErrorInfo, ErrorResponse, encode

_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "service_unavailable"),
}


class APIError(Exception):
    """Raised anywhere while serving a request; becomes the JSON error response."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        default_type, default_code = _TYPES.get(status, ("invalid_request_error" if status < 500 else "server_error",
                                                          None))
        self.status = status
        self.message = message
        self.type = type or default_type
        self.param = param
        self.code = code if code is not None else default_code
        self.headers = headers or {}

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def body(self) -> bytes:
        return encode(ErrorResponse(error=self.info()))

    def response(self) -> Response:
        return Response(self.body(), status_code=self.status, media_type="application/json", headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def from_msgspec(error: msgspec.DecodeError) -> APIError:
    """A body that is not JSON, or JSON of the wrong shape, as a 400 naming the offending field."""
    text = str(error)
    if not isinstance(error, msgspec.ValidationError):
        return bad_request(f"Invalid JSON in the request body: {text}")
    match = _PATH.search(text)
    param = match.group(1) or None if match else None
    return bad_request(f"Invalid request: {text}", param=param)
