"""The engine core's own process: runs ``LLMEngine`` steps and talks to the API process over two pipes.

At thousands of tokens/s, per-token HTTP work in the engine's process would hold the GIL longer
than a decode step takes (vLLM V1 keeps its engine core apart for the same reason), so under the server the
engine lives here. The API process sends ``messages.ToCore`` commands on one pipe; this loop answers on
the other with one ``StepOutputs`` per step. When there is no work the loop blocks on the command pipe, so
an idle server uses no CPU.

Tests exercise the failed-step path with a healthy model through ``EngineConfig.fault_injector``
(cvllm.testing.faults), which travels to this process inside the config; one with an ``install(engine)`` method
(``FaultPlan``) is installed on the engine once it is built, to reach the forward pass and sampling too.

While it works, the core says something at least every ``HEARTBEAT_S`` (its counters, when a long prefill has no
tokens to report), so the API process's supervisor can tell a slow core from a hung one (--engine-hang-timeout).

Most step errors fail only that step's requests. A device error or an ``EngineBrokenError`` (a tensor-parallel
worker died or hung) ends the core instead: it sends ``CoreDead`` with the reason, which fails every open request and
turns ``/health`` to 503, and exits, ending its workers. With tensor parallelism the idle wait also watches the
workers, so one that dies while nothing runs shows on ``/health`` at once, not at the next request.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import msgspec
import torch

from cvllm.engine.build import build_engine
from cvllm.engine.config import EngineConfig
from cvllm.engine.embedding import Embedder
from cvllm.engine.errors import EngineBrokenError
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine_process.deltas import DeltaBuilder, core_stats
from cvllm.engine_process.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    Embeddings,
    EmbedRequest,
    FromCore,
    Ready,
    RequestFailed,
    SeqDelta,
    Shutdown,
    StepOutputs,
    ToCore,
    reject_command,
)
from cvllm.startup import process_age

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0   # the longest a working core stays silent (the hang detector's timeout is far longer)
NOT_FINITE = "the model's logits for this request were NaN or infinite"


def run_core(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int = logging.INFO) -> None:
    """The child process's entry point: build the engine, say Ready (or CoreDead), then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the API process decides
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    channel = CoreChannel(commands, outputs)
    try:
        engine = build_engine(config, imports_seconds=process_age())
    except Exception as e:
        logger.exception("the engine could not start")
        channel.send_quietly(CoreDead(describe(e)))
        sys.exit(1)
    if hasattr(config.fault_injector, "install"):   # a test's fault plan (cvllm.testing.faults)
        config.fault_injector.install(engine)
    core = EngineCore(engine, channel)
    signal.signal(signal.SIGTERM, _terminate)   # a launcher (torchrun) may signal the whole group
    try:
        channel.send(core.ready())
        code = core.run()
    except (EOFError, OSError):
        logger.info("the API process went away; the engine core exits")
        code = 0
    except _Terminated:
        logger.info("SIGTERM: the engine core ends its tensor-parallel workers and exits")
        code = 0
    except Exception as e:   # a bug in this loop, not in a step: say why before going
        logger.exception("the engine core failed")
        channel.send_quietly(CoreDead(describe(e)))
        code = 1
    _shutdown_quietly(engine)
    sys.exit(code)


class _Terminated(BaseException):
    """SIGTERM arrived: not an Exception, so no step's error handling takes it for a failed step."""


def _terminate(signum, frame) -> None:
    raise _Terminated


def _shutdown_quietly(engine) -> None:
    """Before exiting: multiprocessing joins a process's non-daemon children (tensor-parallel workers) before any
    atexit handler could end them, so the engine ends them here."""
    try:
        engine.shutdown()
    except Exception:
        logger.exception("the engine's shutdown failed")


class CoreChannel:
    """Both pipe ends of the core, with one msgpack encoder and decoder."""

    def __init__(self, commands: Connection, outputs: Connection):
        self.commands, self.outputs = commands, outputs
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCore)

    def recv(self) -> ToCore | RequestFailed:
        """Blocks until a command arrives; EOFError once the API process is gone. A request whose parameters fail
        validation here comes back as its RequestFailed, to be sent."""
        data = self.commands.recv_bytes()
        try:
            return self._decoder.decode(data)
        except msgspec.ValidationError as e:
            return reject_command(data, e)

    def pending(self) -> bool:
        return self.commands.poll(0)   # also true at EOF, so the next recv raises EOFError

    def wait(self, sentinels: list[int]) -> bool:
        """Block until a command arrives (True) or one of ``sentinels`` is ready (False)."""
        return self.commands in wait([self.commands, *sentinels])

    def send(self, message: FromCore) -> None:
        self.outputs.send_bytes(self._encoder.encode(message))

    def send_quietly(self, message: FromCore) -> None:
        try:
            self.send(message)
        except OSError:
            pass   # nobody is listening any more; the exit code tells the rest


class _Exit(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class EngineCore:
    def __init__(self, engine: LLMEngine, channel: CoreChannel):
        self.engine = engine
        self.channel = channel
        self.deltas = DeltaBuilder(engine)   # the same conversion the in-process client uses
        self.embedder = Embedder(engine)     # embedding requests, a forward pass of them between steps
        self._stats_sent = True
        self._said_at = time.monotonic()   # the last StepOutputs sent
        # ready when a tensor-parallel worker process ends (TensorParallelExecutor.sentinels); none in one process
        self._worker_sentinels = engine.executor.sentinels()

    def ready(self) -> Ready:
        engine = self.engine
        scheduler = engine.scheduler
        return Ready(max_model_len=engine.max_model_len, num_kv_blocks=scheduler.block_manager.num_blocks,
                     block_size=scheduler.block_manager.block_size, backend=engine.backend.name,
                     dtype=str(engine.dtype).removeprefix("torch."), max_num_seqs=scheduler.config.max_num_seqs,
                     vocab_size=engine.checkpoint.config.vocab_size, pooling=engine.checkpoint.pooling,
                     hidden_size=engine.checkpoint.config.hidden_size,
                     matryoshka_dimensions=engine.checkpoint.config.get("matryoshka_dimensions"))

    def run(self) -> int:
        """Serve until Shutdown (0), a device error (1) or the API process's end (EOFError)."""
        progressed = False
        try:
            while True:
                if not progressed:
                    self._send_stats_if_stale()   # the last snapshot must show the idle state (freed blocks)
                    self._wait_idle()
                    self._handle(self.channel.recv())   # idle: block, using no CPU
                while self.channel.pending():
                    self._handle(self.channel.recv())
                # embeddings and generation take turns, a forward pass each: neither waits for the other to finish
                progressed = self.embedder.has_work() and self._embed_step()
                progressed = (self.engine.has_unfinished() and self._step()) or progressed
        except _Exit as e:
            return e.code

    # -- commands --------------------------------------------------------------------------------

    def _handle(self, command: ToCore | RequestFailed) -> None:
        self._stats_sent = False
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, EmbedRequest):
            self._add_embedding(command)
        elif isinstance(command, RequestFailed):
            self.channel.send(command)
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self.deltas.abort(request_id, command.indices)   # indices: only those completions
                self.embedder.abort(request_id)
        elif isinstance(command, Shutdown):
            logger.info("shutting down")
            raise _Exit(0)

    def _add(self, command: AddRequest) -> None:
        try:
            if command.resumed is None:
                self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
            else:
                seqs = self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                               resumed=command.resumed)
                self.deltas.resumed(seqs)
        except Exception as e:
            invalid = isinstance(e, (ValueError, TypeError))
            if invalid:
                logger.info("request %s rejected: %s", command.request_id, e)
            else:
                logger.exception("request %s could not be added", command.request_id)
            self.channel.send(RequestFailed([command.request_id], describe(e), invalid_request=invalid))

    def _add_embedding(self, command: EmbedRequest) -> None:
        try:
            self.embedder.add(command.request_id, command.prompts, command.pooling, command.dimensions)
        except ValueError as e:
            logger.info("embedding request %s rejected: %s", command.request_id, e)
            self.channel.send(RequestFailed([command.request_id], describe(e), invalid_request=True))

    def _embed_step(self) -> bool:
        """One forward pass of queued embedding inputs; False when none could run (they wait for KV blocks that
        generation holds). A failed pass fails its requests, as a failed step does."""
        try:
            finished = self.embedder.step()
        except Exception as e:
            if is_device_error(e) or isinstance(e, EngineBrokenError):
                self._die(describe(e), e)
            request_ids = self.embedder.last_request_ids
            # a ValueError says what this engine cannot embed (tensor parallelism, no model): the client's to fix
            invalid = isinstance(e, ValueError)
            if invalid:
                logger.info("embedding requests %s refused: %s", ", ".join(request_ids), e)
            else:
                logger.exception("an embedding pass failed; failing its requests: %s", ", ".join(request_ids))
            self.channel.send(RequestFailed(request_ids, describe(e), invalid_request=invalid))
            return True
        if finished is None:
            return False
        for job in finished:
            self.channel.send(Embeddings(job.request_id, [float32_bytes(vector) for vector in job.vectors]))
        return True

    # -- steps -----------------------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step; False when it could schedule nothing (then wait for a command, don't spin)."""
        self.engine.last_batch = None
        try:
            seqs = self.engine.step()
            deltas = self.deltas.deltas(seqs)
        except Exception as e:
            self._fail_step(e)
            return True
        if any(delta.finish_reason == "error" for delta in deltas):
            deltas = self._fail_not_finite(deltas)
        self.deltas.release_finished(deltas)
        # a step that only ran a prefill chunk has nothing to say, but says it is alive now and then (the heartbeat)
        if deltas or time.monotonic() - self._said_at > HEARTBEAT_S:
            self.channel.send(StepOutputs(deltas, core_stats(self.engine)))
            self._said_at = time.monotonic()
            self._stats_sent = True
        else:
            self._stats_sent = False
        # progress: tokens came back, a batch ran, or one is still in flight (async scheduling)
        return bool(seqs) or bool(self.engine.last_batch and self.engine.last_batch.seqs) \
            or self.engine.has_step_in_flight

    def _fail_not_finite(self, deltas: list[SeqDelta]) -> list[SeqDelta]:
        """The engine ended these completions because their logits were not finite: their requests fail (no more of
        their tokens go out), the others' deltas are returned."""
        failed = sorted({delta.request_id for delta in deltas if delta.finish_reason == "error"})
        for request_id in failed:
            self.deltas.abort(request_id)
        self.channel.send(RequestFailed(failed, NOT_FINITE))
        failed_ids = set(failed)
        return [delta for delta in deltas if delta.request_id not in failed_ids]

    def _wait_idle(self) -> None:
        """Idle with tensor-parallel workers: block until a command arrives, or end the core now if a worker ends
        meanwhile (so /health shows it). Without workers, the recv that follows does the blocking."""
        if not self._worker_sentinels or self.channel.wait(self._worker_sentinels):
            return
        try:
            self.engine.executor.check()   # raises, naming the worker and how it ended
        except EngineBrokenError as e:
            self._die(describe(e), e)
        self._die("a tensor-parallel worker process ended", None)

    def _die(self, reason: str, error: BaseException | None) -> NoReturn:
        """The engine cannot go on: tell the API process why (it fails every open request with it and turns /health
        to 503), then exit; run_core shuts the engine down, which ends any tensor-parallel workers."""
        logger.error("the engine core cannot go on: %s", reason, exc_info=error)
        self.channel.send_quietly(CoreDead(reason))
        raise _Exit(1)

    def _fail_step(self, error: Exception) -> None:
        if is_device_error(error):
            self._die(f"device error: {describe(error)}", error)
        if isinstance(error, EngineBrokenError):
            self._die(describe(error), error)
        if self.engine.last_batch is not None:
            request_ids = sorted({seq.request_id for seq in self.engine.last_batch.seqs})
        else:   # it failed while scheduling: every request's state is suspect
            request_ids = sorted(self.engine.requests)
        logger.exception("an engine step failed; failing its requests: %s", ", ".join(request_ids))
        for request_id in request_ids:
            self.deltas.abort(request_id)   # frees their KV blocks and forgets what was sent of them
        self.channel.send(RequestFailed(request_ids, describe(error)))

    def _send_stats_if_stale(self) -> None:
        if not self._stats_sent:
            self.channel.send(StepOutputs([], core_stats(self.engine)))
            self._stats_sent = True


def float32_bytes(vector: torch.Tensor) -> bytes:
    """A host vector as little-endian float32 bytes, the wire form of an embedding (and base64's payload)."""
    return vector.float().contiguous().numpy().astype("<f4", copy=False).tobytes()


def is_device_error(error: BaseException) -> bool:
    """Errors after which the device context is unusable (a CUDA error poisons it for the process)."""
    names = ("AcceleratorError", "CudaError", "DeferredCudaCallError")
    types = tuple(t for module in (torch, torch.cuda) for name in names if (t := getattr(module, name, None)))
    return isinstance(error, types) or "CUDA error" in str(error)


def describe(error: BaseException) -> str:
    """A one-line message for the client: no traceback; the type only where the text alone says little."""
    text = str(error)
    if text and isinstance(error, (ValueError, RuntimeError, OSError)):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
