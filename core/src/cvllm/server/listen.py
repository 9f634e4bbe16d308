"""The server's listening socket. cvserve checks the address before it resolves or loads the model, and the
server binds it before it opens the model, so a port in use costs the user one clear line, not a wait and
a traceback from inside hypercorn."""

from __future__ import annotations

import socket

# hypercorn's default listen backlog is 100, less than a burst of clients opening streams at once (the
# H200 serving bench: 30 of 256 streams ended in a bare ReadError with it, none with 2048; not seen on a 2-core
# VM, so the cause is likely rather than proven); uvicorn and vLLM listen with 2048
BACKLOG = 2048


class AddressError(RuntimeError):
    """The server cannot listen on its host and port; the message says which and why."""


def bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port``, set up as hypercorn sets up its own; AddressError if the
    address is in use, not ours to bind (a port below 1024), or not this machine's."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def check_address(host: str, port: int) -> None:
    """Raise AddressError now if the server could not listen on ``host:port``."""
    listen_socket(host, port).close()
