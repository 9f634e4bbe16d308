"""The built-in chat page: ``index.html`` at ``/``, its scripts and style under ``/ui/``, and
``/ui-config.json`` telling the page where the API is. Served on the API's port (the default), or by a
small app of its own on another port (``--ui-server``, as candle-vllm does), whose origin the API then
allows through CORS. The page and its assets need no API key: the page asks the user for it.

Plain files shipped in the package (cvllm/server/ui/), no build step and no third-party code, so the page
works on a machine with no network."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from cvllm.server.errors import APIError

UI_DIR = Path(__file__).with_name("ui")
ASSET_PREFIX = "/ui/"
CONFIG_PATH = "/ui-config.json"
PAGE_PATHS = frozenset({"/", "/index.html", CONFIG_PATH})
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# the page's own files may be fetched; scripts and styles only from them (model output can never run code)
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'{api}; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_open_path(path: str) -> bool:
    """The page's paths, which the API-key check lets through."""
    return path in PAGE_PATHS or path.startswith(ASSET_PREFIX)


@functools.cache
def _asset(name: str) -> bytes:
    return (UI_DIR / name).read_bytes()


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _api_origin(request: Request, api_port: int | None) -> str:
    """Where the page reaches the API: its own origin (""), or the same host as the page on the API's port."""
    if api_port is None:
        return ""
    return f"{request.url.scheme}://{_bracketed(request.url.hostname or '127.0.0.1')}:{api_port}"


def _file_response(name: str, headers: dict[str, str] | None = None) -> Response:
    return Response(_asset(name), media_type=ASSETS[name],
                    headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", **(headers or {})})


def ui_routes(api_port: int | None, api_key_required: bool) -> list[Route]:
    """The page's routes; ``api_port``: None when the page is on the API's own port, else the API's port."""

    async def page(request: Request) -> Response:
        api = _api_origin(request, api_port)
        return _file_response("index.html", {"Content-Security-Policy": _CSP.format(api=f" {api}" if api else ""),
                                             "Referrer-Policy": "no-referrer"})

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS or name == "index.html":
            return _not_found(request)
        return _file_response(name)

    async def config(request: Request) -> Response:
        body = {"api_base": _api_origin(request, api_port), "api_key_required": api_key_required}
        return Response(json.dumps(body), media_type="application/json", headers={"Cache-Control": "no-store"})

    return [Route("/", page, methods=["GET"]), Route("/index.html", page, methods=["GET"]),
            Route(ASSET_PREFIX + "{name}", asset, methods=["GET"]), Route(CONFIG_PATH, config, methods=["GET"])]


def _not_found(request: Request) -> Response:
    return APIError(404, f"No route {request.method} {request.url.path}.").response()


def build_ui_app(api_port: int, api_key_required: bool) -> Starlette:
    """The app of ``--ui-server``: the page alone, talking to the API on ``api_port`` of the same host."""
    async def not_found(request: Request, exc: Exception) -> Response:
        return _not_found(request)
    return Starlette(routes=ui_routes(api_port, api_key_required), exception_handlers={404: not_found})


def ui_origins(host: str, ui_port: int) -> tuple[list[str], str | None]:
    """The origins a page served by ``--ui-server`` on ``host:ui_port`` has, for the API's CORS: (exact origins,
    a regex of origins or None). Listening on every interface, the page may be reached by any name of the
    machine, so any host on the UI's port is allowed; on loopback, its usual names."""
    if host in WILDCARD_HOSTS:
        return [], rf"https?://[^/]+:{ui_port}"
    hosts = ["127.0.0.1", "localhost", "[::1]"] if host in LOOPBACK_HOSTS else [_bracketed(host)]
    return [f"{scheme}://{h}:{ui_port}" for h in hosts for scheme in ("http", "https")], None
