"""Start the server: read the checkpoint's tokenizer here, start the engine core in its own process, and
serve the app with hypercorn; stop gracefully on SIGTERM/SIGINT.

The HTTP port opens before the model has loaded, so ``/health`` can answer 503 while it loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from cvllm.engine_process.client import EngineCoreClient, EngineStartupError
from cvllm.server.app import build_app
from cvllm.server.args import ServerArgs
from cvllm.server.listen import BACKLOG, AddressError, bind_address, listen_socket, quiet_dropped_connections
from cvllm.server.memory import freeze_startup_objects, release_memory_loop
from cvllm.server.reasoning import reasoning_parser
from cvllm.server.state import ServerState
from cvllm.server.supervisor import supervise
from cvllm.server.tool_calls import tool_parser
from cvllm.server.ui import build_ui_app

logger = logging.getLogger("cvllm.server")

KEEP_ALIVE_S = 30   # an idle connection is closed after this long


class EngineGaveUp(RuntimeError):
    """The engine core kept dying (supervisor.py): the server stopped, to exit non-zero."""


class StartupError(RuntimeError):
    """The server cannot start (the model cannot be opened, a setting is wrong); the message says why."""


def _hypercorn_config(args: ServerArgs, listener_fd: int) -> Config:
    """hypercorn serves on the socket we bound (its ``fd://`` binding), which it then owns and closes."""
    config = Config()
    config.bind = [f"fd://{listener_fd}"]
    config.graceful_timeout = args.shutdown_timeout
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.keep_alive_timeout = KEEP_ALIVE_S
    config.backlog = BACKLOG
    return config


async def run_server(args: ServerArgs) -> None:
    """Serve until SIGTERM/SIGINT; raises StartupError, AddressError or EngineStartupError if it cannot start."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.reasoning_parser is not None:
            reasoning_parser(args.reasoning_parser)
        if args.tool_call_parser is not None:
            tool_parser(args.tool_call_parser)
    except ValueError as e:
        raise StartupError(str(e)) from None
    # Bound before the model is opened, and by us rather than inside hypercorn: a port in use fails at once,
    # as one AddressError (hypercorn would fail after its lifespan started, in a cascade of tracebacks).
    listener = listen_socket(args.host, args.port, args.send_timeout)
    try:
        ui_listener = (listen_socket(args.host, args.ui_port, args.send_timeout)
                       if args.ui and args.ui_port is not None else None)
    except AddressError:
        listener.close()
        raise
    args = _bound_ports(args, listener, ui_listener)
    # The engine core starts first: its imports and the model load (the long part) run while this process opens
    # the tokenizer and starts serving /health
    launch = EngineCoreClient.launch(args.engine)
    try:
        state = ServerState.open(args)
        app = build_app(state)
    except (OSError, ValueError) as e:   # no such model, a malformed checkpoint, no tokenizer
        _close(listener, ui_listener)
        launch.kill()
        raise StartupError(f"cannot open {args.engine.model}: {e}") from e
    except BaseException:
        _close(listener, ui_listener)
        launch.kill()
        raise
    loop = asyncio.get_running_loop()
    quiet_dropped_connections(loop)
    stop = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logger.info("shutting down: no new connections; waiting up to %g s for requests in flight",
                        args.shutdown_timeout)
            stop.set()
        else:   # a second Ctrl-C: do not wait for the stragglers
            logger.info("second signal: stopping now")
            serving.cancel()

    config = _hypercorn_config(args, listener.detach())
    serving = asyncio.ensure_future(_serve_all(app, config, args, ui_listener, stop))
    starting = asyncio.ensure_future(launch.ready(args.startup_timeout))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await asyncio.wait([serving, starting], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():       # the server stopped (a signal) during loading
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await _finish(serving)
            return
        try:
            state.client = starting.result()
            state.client.hold_on_death = True   # at once: a death before the supervisor runs is resumed too
        except EngineStartupError as e:
            state.startup_error = f"The engine failed to start: {e}"
            stop.set()
            await _finish(serving)
            raise
        _log_ready(state, args)
        freeze_startup_objects()
        supervising = asyncio.ensure_future(supervise(state, args, stop))
        # past the keep-alive timeout, the idle server's last connections are closed: their garbage goes too
        releasing = asyncio.ensure_future(release_memory_loop(state, idle_s=KEEP_ALIVE_S + 5))
        await _finish(serving)
        for task in (supervising, releasing):
            task.cancel()
        await asyncio.gather(supervising, releasing, return_exceptions=True)
        if state.gave_up:
            raise EngineGaveUp(state.gave_up)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if state.client is not None:
            await state.client.shutdown()
    logger.info("server stopped")


def _bound_ports(args: ServerArgs, listener: socket.socket, ui_listener: socket.socket | None) -> ServerArgs:
    """``args`` with the ports really bound (port 0 means any free one): the page and CORS need them."""
    ui_port = ui_listener.getsockname()[1] if ui_listener is not None else args.ui_port
    return dataclasses.replace(args, port=listener.getsockname()[1], ui_port=ui_port)


def _close(*listeners: socket.socket | None) -> None:
    for sock in listeners:
        if sock is not None:
            sock.close()


async def _serve_all(app, config: Config, args: ServerArgs, ui_listener: socket.socket | None,
                     stop: asyncio.Event) -> None:
    """The API, and the chat page's own server beside it (--ui-server); both stop on ``stop``."""
    if ui_listener is None:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait)
        return
    ui_app = build_ui_app(args.port, api_key_required=bool(args.api_key))
    ui_config = _hypercorn_config(args, ui_listener.detach())
    await asyncio.gather(hypercorn_serve(app, config, shutdown_trigger=stop.wait),
                         hypercorn_serve(ui_app, ui_config, shutdown_trigger=stop.wait))


async def _finish(serving: asyncio.Future) -> None:
    try:
        await serving
    except asyncio.CancelledError:
        pass


def _log_ready(state: ServerState, args: ServerArgs) -> None:
    info = state.client.info
    names = ", ".join(state.model_names)
    logger.info("serving %s (%s) on http://%s — backend %s, dtype %s, KV cache %d blocks × %d = %d tokens, "
                "max_model_len %d, max_num_seqs %d%s", names, state.model_path, bind_address(args.host, args.port),
                info.backend, info.dtype, info.num_kv_blocks, info.block_size, info.num_kv_blocks * info.block_size,
                info.max_model_len, info.max_num_seqs,
                f", reasoning parser {state.reasoning_parser}" if state.reasoning_parser else "")
    if args.ui:
        logger.info("chat page on http://%s/", bind_address(args.host, args.ui_port or args.port))


def serve(args: ServerArgs) -> int:
    """Run the server to the end; the process exit code (0 after a clean shutdown)."""
    try:
        asyncio.run(run_server(args))
    except StartupError as e:
        logger.error("%s", e)
        return 1
    except EngineStartupError as e:
        logger.error("the engine failed to start: %s", e)
        return 1
    except EngineGaveUp:   # (logged by the supervisor)
        return 1
    except AddressError as e:   # 2, as cvserve's own check of the address before the server starts
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
