"""The API process's side of the engine core: spawn it, send commands, stream each request's deltas.

Lives in the server's asyncio loop. Commands are written to the pipe from the loop thread (they
are small); one reader thread receives the core's messages and hands them to the loop with
``call_soon_threadsafe``, where they are routed to per-request ``RequestStream``s (stream.py).

Each stream keeps what resubmitting its request needs: the prompt, the parameters and every token it was sent. With
``hold_on_death`` (the server's supervisor sets it) a core that dies leaves its streams open, held, instead of
failing them; ``take_held`` hands them to the supervisor, which ``resume``s them on the next core, where each
continues after the tokens its client has (server/supervisor.py).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Collection
from multiprocessing.connection import Connection, wait

import msgspec

from cvllm.engine.config import EngineConfig
from cvllm.engine_process.entry import run_core
from cvllm.engine_process.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreStats,
    Embeddings,
    EmbedRequest,
    FromCore,
    Ready,
    RequestFailed,
    Shutdown,
    StepOutputs,
    ToCore,
)
from cvllm.engine_process.stream import EngineDeadError, RequestError, RequestStream
from cvllm.pooling import PoolingConfig
from cvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message is the core's own."""


class EngineCoreClient:
    def __init__(self, process: multiprocessing.process.BaseProcess, commands: Connection, outputs: Connection,
                 info: Ready, loop: asyncio.AbstractEventLoop):
        self.info = info
        self.stats = CoreStats(kv_blocks_total=info.num_kv_blocks, kv_blocks_free=info.num_kv_blocks)
        self.dead: str | None = None
        # the core's death leaves its streams open for a supervisor to resume on the next core (take_held)
        self.hold_on_death = False
        self._held = False
        self._kill_reason: str | None = None
        self.last_heard = time.monotonic()   # the core's last message, or when work arrived at an idle core
        self._process = process
        self._commands, self._outputs = commands, outputs
        self._loop = loop
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._embeddings: dict[str, asyncio.Future[list[bytes]]] = {}   # embedding requests awaiting their vectors
        self._closing = False
        self._exited = asyncio.Event()   # set once the core's pipe closed and the process was reaped
        self._reader = threading.Thread(target=self._read_outputs, name="cvllm-core-reader", daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, config: EngineConfig) -> CoreLaunch:
        """Spawn the engine core now and return at once: it imports and loads the model while the caller does
        its own start-up work; ``await launch.ready()`` then gives the client."""
        context = multiprocessing.get_context("spawn")
        commands_reader, commands_writer = context.Pipe(duplex=False)
        outputs_reader, outputs_writer = context.Pipe(duplex=False)
        log_level = logging.getLogger("cvllm").getEffectiveLevel()
        # Not a daemon: a daemonic process cannot have children, and with tensor parallelism the core starts its
        # workers. What a daemon got for free, ending with this process, comes from atexit here (a normal exit;
        # multiprocessing would otherwise wait for the core) and from EOF on the commands pipe (any exit).
        process = context.Process(target=run_core, name="cvllm-engine-core", daemon=False,
                                  args=(config, commands_reader, outputs_writer, log_level))
        process.start()
        _live_cores.add(process)
        # The child holds these ends now; closing ours is what makes EOF mean "the core is gone".
        commands_reader.close()
        outputs_writer.close()
        return CoreLaunch(process, commands_writer, outputs_reader)

    @classmethod
    async def start(cls, config: EngineConfig, startup_timeout: float | None = None) -> EngineCoreClient:
        return await cls.launch(config).ready(startup_timeout)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exit_code(self) -> int | None:
        """The core process's exit code once it has exited (0 after a clean shutdown), else None."""
        return self._process.exitcode

    @property
    def num_in_flight(self) -> int:
        return len(self._streams) + len(self._embeddings)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        if self.dead is not None or self._closing:
            raise EngineDeadError(f"the engine core is not running: {self.dead or 'shutting down'}")
        if request_id in self._streams:
            raise ValueError(f"request id '{request_id}' is already in flight")
        stream = RequestStream(self, request_id, params.n, list(prompt_token_ids), params)
        self._note_work()
        self._send(AddRequest(request_id, stream.prompt_token_ids, params))
        self._streams[request_id] = stream
        return stream

    def resume(self, stream: RequestStream) -> None:
        """Take over a stream of a core that died: the request goes on here from the tokens it was sent."""
        if self.dead is not None or self._closing:
            raise EngineDeadError(f"the engine core is not running: {self.dead or 'shutting down'}")
        self._note_work()
        self._send(stream.resume_message())
        stream._client = self
        self._streams[stream.request_id] = stream

    def take_held(self) -> list[RequestStream]:
        """The streams this dead core held for resuming (``hold_on_death``), in the order they arrived; they are
        no longer this client's."""
        streams, self._streams = list(self._streams.values()), {}
        return streams

    def fail_held(self) -> None:
        """Give up on the streams held for resuming: they fail with the core's death, as without hold_on_death."""
        self._held = False
        self._mark_dead(self.dead or "the engine core is gone")

    def kill(self, reason: str) -> None:
        """End a core that stopped making progress (SIGKILL); it is then handled as any core that died, ``reason``
        saying why."""
        self._kill_reason = reason
        self._process.kill()

    def _note_work(self) -> None:
        if not self._streams and not self._embeddings:
            self.last_heard = time.monotonic()   # an idle core's silence was no hang: the clock starts now

    def abort(self, request_id: str, indices: Collection[int] | None = None) -> None:
        """Stop a request, or only its completions ``indices``; the core sends nothing more for those (no finish)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return   # finished, failed or aborted already
        message = AbortRequests([request_id])
        if indices is not None:
            stream._unfinished.difference_update(indices)
            if stream._unfinished:   # its siblings go on: the stream ends when they have finished
                message.indices = sorted(indices)
        if message.indices is None:
            del self._streams[request_id]
            stream._stop()
        if self.dead is None:
            try:
                self._send(message)
            except EngineDeadError:
                pass   # the core is gone, and its blocks with it

    async def embed(self, request_id: str, prompts: list[list[int]], pooling: PoolingConfig,
                    dimensions: int | None = None) -> list[bytes]:
        """Embed ``prompts`` in the core: one little-endian float32 vector per prompt. RequestError if the core
        refuses or fails them; cancelling (the client left) drops the request in the core."""
        if self.dead is not None or self._closing:
            raise EngineDeadError(f"the engine core is not running: {self.dead or 'shutting down'}")
        if request_id in self._embeddings or request_id in self._streams:
            raise ValueError(f"request id '{request_id}' is already in flight")
        future = self._loop.create_future()
        self._note_work()
        self._send(EmbedRequest(request_id, prompts, pooling, dimensions))
        self._embeddings[request_id] = future
        try:
            return await future
        except asyncio.CancelledError:
            if self._embeddings.pop(request_id, None) is not None and self.dead is None:
                try:
                    self._send(AbortRequests([request_id]))
                except EngineDeadError:
                    pass   # the core is gone, and its blocks with it
            raise

    async def wait_exited(self) -> None:
        """Until the core process has ended, whatever ended it (the server's supervisor waits on this)."""
        await self._exited.wait()

    @property
    def closing(self) -> bool:
        """``shutdown`` was called: the core's end is wanted."""
        return self._closing

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the core to exit; kill it if it has not within ``timeout`` seconds."""
        if not self._closing:
            self._closing = True
            if self.dead is None:
                try:
                    self._send(Shutdown())
                except EngineDeadError:
                    pass
        try:
            await asyncio.wait_for(self._exited.wait(), timeout)
        except TimeoutError:
            logger.warning("the engine core did not exit within %g s; killing it", timeout)
            self._process.kill()
            await self._exited.wait()
        _live_cores.discard(self._process)
        self._mark_dead("the engine core was shut down")
        await self._loop.run_in_executor(None, self._reader.join)
        self._commands.close()
        self._outputs.close()

    def _send(self, message: ToCore) -> None:
        with self._send_lock:   # one writer at a time, whichever thread calls
            try:
                self._commands.send_bytes(self._encoder.encode(message))
            except OSError as e:
                raise EngineDeadError(f"the engine core is not running: {self.dead or e}") from e

    # -- the core's messages (reader thread, then the loop) ----------------------------------------

    def _read_outputs(self) -> None:
        decoder = msgspec.msgpack.Decoder(FromCore)
        while True:
            try:
                data = self._outputs.recv_bytes()
            except (EOFError, OSError):
                break
            try:
                message = decoder.decode(data)
            except msgspec.DecodeError:   # the two sides disagree on the protocol: nothing can be trusted
                logger.exception("undecodable message from the engine core; stopping it")
                self._process.kill()
                continue   # EOF follows, and with it the dead state
            if not self._post(self._on_message, message):
                return   # the loop is closed: nobody is left to tell
        self._process.join(10)   # the pipe closed: the process is exiting; reap it for its exit code
        _live_cores.discard(self._process)
        self._post(self._on_exit, self._process.exitcode)

    def _post(self, callback, *args) -> bool:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
            return True
        except RuntimeError:
            return False

    def _on_message(self, message: FromCore) -> None:
        self.last_heard = time.monotonic()
        if isinstance(message, StepOutputs):
            self.stats = message.stats
            for delta in message.deltas:
                stream = self._streams.get(delta.request_id)
                if stream is None:
                    continue   # aborted here while the core was stepping it
                stream._deliver(delta)
                if stream.finished:
                    del self._streams[delta.request_id]
        elif isinstance(message, Embeddings):
            future = self._embeddings.pop(message.request_id, None)
            if future is not None and not future.done():
                future.set_result(message.vectors)
        elif isinstance(message, RequestFailed):
            for request_id in message.request_ids:
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    stream._fail(RequestError(message.message, message.invalid_request))
                future = self._embeddings.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_exception(RequestError(message.message, message.invalid_request))
        elif isinstance(message, CoreDead):
            self._mark_dead(message.message)

    def _on_exit(self, exit_code: int | None) -> None:
        if self._kill_reason is not None:
            self._mark_dead(f"the engine core was killed ({describe_exit(exit_code)}): {self._kill_reason}")
        elif not self._closing:
            self._mark_dead(f"the engine core exited unexpectedly ({describe_exit(exit_code)})")
        self._exited.set()

    def _mark_dead(self, reason: str) -> None:
        if self.dead is None:
            self.dead = reason
            if not self._closing:
                logger.error("engine core dead: %s", reason)
                self._held = self.hold_on_death
        if not self._held:
            streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream._fail(EngineDeadError(self.dead))
        embeddings, self._embeddings = self._embeddings, {}
        for future in embeddings.values():
            if not future.done():
                future.set_exception(EngineDeadError(self.dead))


def describe_exit(exit_code: int | None) -> str:
    """A process's end in words: its exit code, or the signal that killed it (multiprocessing's negative codes)."""
    if exit_code is not None and exit_code < 0:
        try:
            return f"exit code {exit_code}: killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"exit code {exit_code}: killed by signal {-exit_code}"
    return f"exit code {exit_code}"


# Engine cores this process started and has not shut down: ended at its exit (one atexit hook for all of them)
_live_cores: set[multiprocessing.process.BaseProcess] = set()


@atexit.register
def _end_live_cores() -> None:
    """At the API process's exit: each core still running (its tensor-parallel workers follow it)."""
    for process in list(_live_cores):
        if process.is_alive():
            process.terminate()
            process.join(timeout=2)
            if process.is_alive():
                process.kill()


def _first_message(outputs: Connection, process: multiprocessing.process.BaseProcess,
                   timeout: float | None) -> FromCore:
    """Wait (in a worker thread) for the core's first message: Ready, or CoreDead."""
    if not wait([outputs, process.sentinel], timeout):
        raise EngineStartupError(f"the engine core did not become ready within {timeout:g} s")
    try:
        return msgspec.msgpack.decode(outputs.recv_bytes(), type=FromCore)
    except EOFError:
        process.join(10)
        raise EngineStartupError(f"the engine core exited during start-up (exit code {process.exitcode})") from None


class CoreLaunch:
    """An engine core process that is starting: wait for its Ready message, or kill it."""

    def __init__(self, process: multiprocessing.process.BaseProcess, commands: Connection, outputs: Connection):
        self.process, self._commands, self._outputs = process, commands, outputs

    async def ready(self, startup_timeout: float | None = None) -> EngineCoreClient:
        process, loop = self.process, asyncio.get_running_loop()
        try:
            first = await loop.run_in_executor(None, _first_message, self._outputs, process, startup_timeout)
        except BaseException:   # start-up failed, timed out or was cancelled: leave no process behind
            self.kill()
            raise
        if isinstance(first, Ready):
            logger.info("engine core ready (pid %d): %s", process.pid, first)
            return EngineCoreClient(process, self._commands, self._outputs, first, loop)
        process.kill()
        await loop.run_in_executor(None, process.join, 10)
        _live_cores.discard(process)
        self._commands.close()
        self._outputs.close()
        if isinstance(first, CoreDead):
            raise EngineStartupError(first.message)
        raise EngineStartupError(f"the engine core sent {type(first).__name__} before Ready")

    def kill(self) -> None:
        """Stop a core that is no longer wanted (the API side failed to start); reaps it, so no zombie is left."""
        self.process.kill()
        self.process.join(5)   # SIGKILL: quick
        _live_cores.discard(self.process)
