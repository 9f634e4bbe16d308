"""The server's listening socket. cvserve checks the address before it resolves or loads the model, and the
server binds it before it opens the model, so a port in use costs the user one clear line, not a wait and
a traceback from inside hypercorn."""

from __future__ import annotations

import asyncio
import logging
import socket

logger = logging.getLogger("cvllm.server")

# hypercorn's default listen backlog is 100, less than a burst of clients opening streams at once (the
# H200 serving bench: 30 of 256 streams ended in a bare ReadError with it, none with 2048; not seen on a 2-core
# VM, so the cause is likely rather than proven); uvicorn and vLLM listen with 2048
BACKLOG = 2048

# A client that stops reading and never closes would hold its connection, its response and what the server has
# queued for it for ever: hypercorn has no write timeout, and the kernel probes a shut receive window without end.
# With TCP_USER_TIMEOUT (Linux; accepted connections inherit it from the listening socket) the kernel drops a
# connection whose data has gone unacknowledged this long; the server then sees the client gone, as if it had
# closed (its request is aborted in the core). A client that reads slowly but reads is not affected.
SEND_TIMEOUT_S = 60.0


class AddressError(RuntimeError):
    """The server cannot listen on its host and port; the message says which and why."""


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int, send_timeout: float = SEND_TIMEOUT_S) -> socket.socket:
    """A TCP socket listening on ``host:port``, set up as hypercorn sets up its own; AddressError if the
    address is in use, not ours to bind (a port below 1024), or not this machine's. ``send_timeout``: seconds
    a client may leave what it was sent unread before its connection is dropped (0: never)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if send_timeout and hasattr(socket, "TCP_USER_TIMEOUT"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(send_timeout * 1000))
        # a restarted server may rebind at once, though connections of the last one are in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.removeprefix("[").removesuffix("]"), port))   # "[::1]" as in URLs, as hypercorn takes it
        # listen now, not when hypercorn starts: with SO_REUSEADDR two servers could both bind a port
        # that nobody listens on yet, and the second would fail later, inside hypercorn
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)   # "Address already in use", not "[Errno 98] Address already in use"
        raise AddressError(f"cannot serve on {bind_address(host, port)}: {reason[:1].lower()}{reason[1:]}") from None
    return sock


def quiet_dropped_connections(loop: asyncio.AbstractEventLoop) -> None:
    """Log a connection the kernel dropped for its send timeout in one line, not as an unhandled exception: hypercorn
    (0.18) closes it expecting a reset or a broken pipe, not ETIMEDOUT, which escapes its connection handler."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if isinstance(context.get("exception"), TimeoutError) and "client_connected_cb" in context.get("message", ""):
            logger.info("dropped a connection whose client left what it was sent unread (send timeout)")
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def check_address(host: str, port: int) -> None:
    """Raise AddressError now if the server could not listen on ``host:port``."""
    listen_socket(host, port).close()
