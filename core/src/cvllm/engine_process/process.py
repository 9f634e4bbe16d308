"""The engine core's own process: runs ``LLMEngine`` steps and talks to the API process over two pipes.

At thousands of tokens/s, per-token HTTP work in the engine's process would hold the GIL longer
than a decode step takes (DESIGN.md §3), so under the server the engine lives here. The API
process sends ``messages.ToCore`` commands on one pipe; this loop answers on the other with one
``StepOutputs`` per step. When there is no work the loop blocks on the command pipe, so an idle
server uses no CPU.

Test hook: with ``CVLLM_CORE_FAIL_STEP_ON_PROMPT_TOKEN=<id>`` in the core's environment, a step
that schedules a sequence whose prompt holds token ``<id>`` raises, so the tests can exercise the
failed-step path with a healthy model. Nothing else reads it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

import msgspec
import torch

from cvllm.engine.config import EngineConfig
from cvllm.engine.llm_engine import LLMEngine
from cvllm.engine.sequence import Sequence
from cvllm.engine_process.messages import (
    AbortRequests,
    AddRequest,
    CoreDead,
    CoreStats,
    FromCore,
    Ready,
    RequestFailed,
    SeqDelta,
    Shutdown,
    StepOutputs,
    ToCore,
    TokenLogprobs,
)
from cvllm.outputs import Logprob
from cvllm.sampling_params import SamplingParams
from cvllm.startup import process_age

logger = logging.getLogger(__name__)

FAIL_STEP_ENV = "CVLLM_CORE_FAIL_STEP_ON_PROMPT_TOKEN"


def run_core(config: EngineConfig, commands: Connection, outputs: Connection, log_level: int = logging.INFO) -> None:
    """The child process's entry point: build the engine, say Ready (or CoreDead), then serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the API process decides
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine core] %(name)s: %(message)s")
    channel = CoreChannel(commands, outputs)
    try:
        engine = LLMEngine(config, imports_seconds=process_age())
    except Exception as e:
        logger.exception("the engine could not start")
        channel.send_quietly(CoreDead(describe(e)))
        sys.exit(1)
    core = EngineCore(engine, channel)
    try:
        channel.send(core.ready())
        code = core.run()
    except (EOFError, OSError):
        logger.info("the API process went away; the engine core exits")
        code = 0
    except Exception as e:   # a bug in this loop, not in a step: say why before going
        logger.exception("the engine core failed")
        channel.send_quietly(CoreDead(describe(e)))
        code = 1
    sys.exit(code)


class CoreChannel:
    """Both pipe ends of the core, with one msgpack encoder and decoder."""

    def __init__(self, commands: Connection, outputs: Connection):
        self.commands, self.outputs = commands, outputs
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToCore)

    def recv(self) -> ToCore:
        """Blocks until a command arrives; EOFError once the API process is gone."""
        return self._decoder.decode(self.commands.recv_bytes())

    def pending(self) -> bool:
        return self.commands.poll(0)   # also true at EOF, so the next recv raises EOFError

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
        self._sent: dict[int, int] = {}   # seq_id -> output tokens already sent (the next delta starts there)
        self._stats_sent = True
        self._install_fault_hook()

    def ready(self) -> Ready:
        engine = self.engine
        scheduler = engine.scheduler
        return Ready(max_model_len=engine.max_model_len, num_kv_blocks=scheduler.block_manager.num_blocks,
                     block_size=scheduler.block_manager.block_size, backend=engine.backend.name,
                     dtype=str(engine.dtype).removeprefix("torch."), max_num_seqs=scheduler.config.max_num_seqs,
                     vocab_size=engine.checkpoint.config.vocab_size)

    def run(self) -> int:
        """Serve until Shutdown (0), a device error (1) or the API process's end (EOFError)."""
        progressed = False
        try:
            while True:
                if not progressed:
                    self._send_stats_if_stale()   # the last snapshot must show the idle state (freed blocks)
                    self._handle(self.channel.recv())   # idle: block, using no CPU
                while self.channel.pending():
                    self._handle(self.channel.recv())
                progressed = self.engine.has_unfinished() and self._step()
        except _Exit as e:
            return e.code

    # -- commands --------------------------------------------------------------------------------

    def _handle(self, command: ToCore) -> None:
        self._stats_sent = False
        if isinstance(command, AddRequest):
            self._add(command)
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self._untrack(request_id)
                self.engine.abort_request(request_id)
        elif isinstance(command, Shutdown):
            logger.info("shutting down")
            raise _Exit(0)

    def _add(self, command: AddRequest) -> None:
        try:
            params = SamplingParams(**command.params)
            self.engine.add_request(command.request_id, command.prompt_token_ids, params)
        except Exception as e:
            invalid = isinstance(e, (ValueError, TypeError))
            if invalid:
                logger.info("request %s rejected: %s", command.request_id, e)
            else:
                logger.exception("request %s could not be added", command.request_id)
            self.channel.send(RequestFailed([command.request_id], describe(e), invalid_request=invalid))

    def _untrack(self, request_id: str) -> None:
        for seq in self.engine.requests.get(request_id, ()):
            self._sent.pop(seq.seq_id, None)

    # -- steps -----------------------------------------------------------------------------------

    def _step(self) -> bool:
        """One engine step; False when it could schedule nothing (then wait for a command, don't spin)."""
        self.engine.last_batch = None
        try:
            seqs = self.engine.step()
            deltas = [self._delta(seq) for seq in seqs]
        except Exception as e:
            self._fail_step(e)
            return True
        for request_id in {seq.request_id for seq in seqs if seq.is_finished}:
            if all(seq.is_finished for seq in self.engine.requests.get(request_id, ())):
                self._untrack(request_id)
                self.engine.release_request(request_id)
        if deltas:   # a step that only ran a prefill chunk has nothing to say
            self.channel.send(StepOutputs(deltas, self._stats()))
        self._stats_sent = bool(deltas)
        # progress: tokens came back, a batch ran, or one is still in flight (async scheduling)
        return bool(seqs) or bool(self.engine.last_batch and self.engine.last_batch.seqs) \
            or self.engine.has_step_in_flight

    def _fail_step(self, error: Exception) -> None:
        if is_device_error(error):
            logger.exception("device error: the engine core cannot go on")
            self.channel.send_quietly(CoreDead(f"device error: {describe(error)}"))
            raise _Exit(1)
        if self.engine.last_batch is not None:
            request_ids = sorted({seq.request_id for seq in self.engine.last_batch.seqs})
        else:   # it failed while scheduling: every request's state is suspect
            request_ids = sorted(self.engine.requests)
        logger.exception("an engine step failed; failing its requests: %s", ", ".join(request_ids))
        for request_id in request_ids:
            self._untrack(request_id)
            self.engine.abort_request(request_id)   # frees their KV blocks
        self.channel.send(RequestFailed(request_ids, describe(error)))

    def _delta(self, seq: Sequence) -> SeqDelta:
        sent = self._sent.get(seq.seq_id, 0)
        new_tokens = seq.token_ids[seq.num_prompt_tokens + sent:]
        self._sent[seq.seq_id] = sent + len(new_tokens)
        logprobs = None
        if seq.logprobs is not None:
            logprobs = [token_logprobs(entry, token) for entry, token in zip(seq.logprobs[sent:], new_tokens)]
        prompt_logprobs = None
        raw_prompt_logprobs = getattr(seq, "prompt_logprobs", None)
        if sent == 0 and raw_prompt_logprobs is not None:
            prompt_ids = seq.token_ids[:seq.num_prompt_tokens]
            prompt_logprobs = [None if entry is None else token_logprobs(entry, token)
                               for entry, token in zip(raw_prompt_logprobs, prompt_ids)]
        stop_reason = seq.stop_reason if isinstance(seq.stop_reason, int) else None
        num_cached_tokens = (seq.num_cached_tokens or 0) if sent == 0 else 0
        return SeqDelta(seq.request_id, seq.index, new_tokens, logprobs, seq.finish_reason, stop_reason,
                        seq.num_prompt_tokens, prompt_logprobs, num_cached_tokens)

    def _stats(self) -> CoreStats:
        scheduler = self.engine.scheduler
        blocks = scheduler.block_manager
        counters = scheduler.stats
        return CoreStats(running=len(scheduler.running), waiting=len(scheduler.waiting),
                         kv_blocks_total=blocks.num_blocks, kv_blocks_free=blocks.num_free_blocks,
                         steps=counters.steps, preemptions=counters.preemptions,
                         prefix_hit_tokens=counters.prefix_hit_tokens,
                         prompt_tokens_computed=counters.prompt_tokens_computed,
                         generated_tokens=counters.generated_tokens)

    def _send_stats_if_stale(self) -> None:
        if not self._stats_sent:
            self.channel.send(StepOutputs([], self._stats()))
            self._stats_sent = True

    def _install_fault_hook(self) -> None:
        """The test hook: a step scheduling a prompt that holds the configured token raises."""
        if not os.environ.get(FAIL_STEP_ENV):
            return
        fail_token = int(os.environ[FAIL_STEP_ENV])
        scheduler = self.engine.scheduler
        schedule = scheduler.schedule

        def schedule_or_fail():
            batch = self.engine.last_batch = schedule()
            if any(fail_token in seq.token_ids[:seq.num_prompt_tokens] for seq in batch.seqs):
                raise RuntimeError(f"injected step failure ({FAIL_STEP_ENV}={fail_token})")
            return batch

        scheduler.schedule = schedule_or_fail


def token_logprobs(entry: dict[int, Logprob], token_id: int) -> TokenLogprobs:
    """One position's logprobs as sent: the chosen token's, then the top-k in rank order."""
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
    return TokenLogprobs(entry[token_id].logprob, [tid for _, tid, _ in ranked], [lp for _, _, lp in ranked])


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
