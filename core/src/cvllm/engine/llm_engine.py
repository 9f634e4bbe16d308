"""The engine: ``step()`` = schedule, run, sample, postprocess (nano-vllm's shape)."""

from __future__ import annotations

import gc
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cvllm import plugins
from cvllm.checkpoint.base import Checkpoint
from cvllm.config import resolve_dtype
from cvllm.engine.block_manager import BlockManager
from cvllm.engine.config import EngineConfig
from cvllm.engine.fake_runner import FakeModelRunner
from cvllm.engine.model_runner import ModelRunner, build_model
from cvllm.engine.penalties import PenaltyHistory
from cvllm.engine.prompt_logprobs import prompt_logprob_rows, record_prompt_logprobs
from cvllm.engine.sampler import SamplerOutput, make_generator
from cvllm.engine.scheduler import EngineStats, ScheduledBatch, Scheduler, SchedulerConfig
from cvllm.engine.sequence import Sequence
from cvllm.outputs import Logprob
from cvllm.sampling_params import SamplingParams
from cvllm.startup import StartupPhases

logger = logging.getLogger(__name__)

BACKEND_PREFERENCE = ("cuda", "metal", "cpu")
CPU_KV_CACHE_BYTES = 4 << 30   # default KV pool on CPU (vLLM's CPU default is 4 GiB too)


def select_backend(name: str | None):
    registry = plugins.backends()
    if name is not None:
        backend_class = registry.get(name)
        if not backend_class.is_available():
            raise RuntimeError(f"backend '{name}' is installed but not available on this machine")
        return backend_class()
    for candidate in [*BACKEND_PREFERENCE, *registry.names()]:
        if candidate in registry and registry.get(candidate).is_available():
            return registry.get(candidate)()
    raise RuntimeError("no available backend")


@dataclass(slots=True)
class InFlightStep:
    """A launched step whose sampled tokens are still on the device."""
    sampling: list[Sequence]        # the sequences that sampled, in the order of out's rows
    out: SamplerOutput | None       # on the device: the next step's decode rows read their input ids here
    readback: Callable[[], list[torch.Tensor]] | None   # waits for out's copy to the host
    scoring: bool                   # it recorded prompt logprobs (such steps finish at once)


class LLMEngine:
    def __init__(self, config: EngineConfig, imports_seconds: float | None = None):
        """``imports_seconds``: what the process spent before creating the engine (the engine core's imports),
        reported as the first phase of the start-up line."""
        self.config = config
        phases = StartupPhases(imports_seconds)
        # a path (opened by whichever plugin claims it), or a Checkpoint built in memory (benchmarks' random weights)
        model = config.model
        self.checkpoint = model if isinstance(model, Checkpoint) else plugins.open_checkpoint(model)
        phases.mark("checkpoint")
        self.tokenizer = self.checkpoint.tokenizer
        self.backend = select_backend(config.backend)
        self.dtype = resolve_dtype(config.dtype, self.checkpoint.config)
        if config.fake_step_ms is not None:
            self.runner = FakeModelRunner(self.checkpoint.config.vocab_size, config.block_size,
                                          config.fake_step_ms / 1000, self.checkpoint.eos_token_ids())
        else:
            model = build_model(self.checkpoint, self.backend, self.dtype, isq=config.isq)
            self.runner = ModelRunner(model, self.backend, config.block_size, self.dtype)
        phases.mark("weights")

        model_config = self.checkpoint.config
        context_len = model_config.get("max_position_embeddings") or 2048
        max_model_len = config.max_model_len or context_len
        if max_model_len > context_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"(max_position_embeddings = {context_len})")
        max_num_seqs = config.max_num_seqs or getattr(self.backend, "default_max_num_seqs", 16)
        num_blocks = self._kv_blocks(max_model_len, max_num_seqs)
        self.runner.allocate_kv_cache(num_blocks)
        phases.mark("KV cache")
        if num_blocks * config.block_size < max_model_len:
            logger.warning("max_model_len %d capped to %d: the KV pool holds only %d blocks",
                           max_model_len, num_blocks * config.block_size, num_blocks)
            max_model_len = num_blocks * config.block_size
        self.max_model_len = max_model_len
        if not config.enforce_eager and config.fake_step_ms is None:
            self.runner.enable_decode_graphs(max_num_seqs, max_model_len)
        phases.mark("graphs")
        if self.backend.host_threads and "OMP_NUM_THREADS" not in os.environ \
                and torch.get_num_threads() != self.backend.host_threads:
            logger.info("torch CPU threads %d -> %d for the %s backend's host work (OMP_NUM_THREADS overrides)",
                        torch.get_num_threads(), self.backend.host_threads, self.backend.name)
            torch.set_num_threads(self.backend.host_threads)
        budget = config.max_num_batched_tokens or getattr(self.backend, "default_max_num_batched_tokens", 2048)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, prefill_chunk_size=config.prefill_chunk_size),
            BlockManager(num_blocks, config.block_size, config.enable_prefix_caching))
        self.sampler = plugins.samplers().get("default")()   # the built-in registers it like any plugin
        if self.backend.argmax is not None and hasattr(self.sampler, "argmax"):
            self.sampler.argmax = self.backend.argmax
        # token counts of penalised sequences, on the device: penalties need no host token list (penalties.py)
        self.penalties = PenaltyHistory(self.checkpoint.config.vocab_size, self.backend.device)
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self.requests: dict[str, list[Sequence]] = {}
        self.last_batch: ScheduledBatch | None = None
        # launch a step before reading the last one's tokens (see step()); the default overlaps on GPUs
        self.async_scheduling = (self.backend.name != "cpu") if config.async_scheduling is None \
            else config.async_scheduling
        self._inflight: InFlightStep | None = None
        self._seq_ids = itertools.count()
        torch.manual_seed(config.seed)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d, backend %s, dtype %s",
                    num_blocks, config.block_size, num_blocks * config.block_size, max_model_len,
                    self.backend.name, self.dtype)
        logger.info("engine started in %s", phases.summary())

    def _kv_blocks(self, max_model_len: int, max_num_seqs: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks:
            return cfg.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block()
        free, total = self.backend.memory()
        if cfg.kv_cache_memory:
            budget = cfg.kv_cache_memory
        elif cfg.kv_fraction:
            budget = int(free * cfg.kv_fraction)
        elif cfg.gpu_memory_utilization:
            # measured after loading, so what is in use already includes the weights
            budget = int(cfg.gpu_memory_utilization * total) - (total - free)
        else:
            budget = min(CPU_KV_CACHE_BYTES, free // 2) if self.backend.name == "cpu" else int(free * 0.9)
        # More blocks than every sequence at full length could use is memory nobody touches.
        useful = max_num_seqs * -(-max_model_len // cfg.block_size)
        blocks = min(budget // per_block, useful)
        if blocks < 1:
            raise RuntimeError(f"no room for a KV cache: {budget} bytes available, {per_block} needed per block")
        return blocks

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[Sequence]:
        if self.runner is None:
            raise RuntimeError("this engine was shut down: its model and KV cache are freed")
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.checkpoint.config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise ValueError(f"{name} must be at most the vocabulary size {vocab}")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than the maximum model "
                             f"length {self.max_model_len}")
        stop_ids = sorted((set() if params.ignore_eos else self.eos_token_ids) | set(params.stop_token_ids))
        now = time.monotonic()
        seqs = []
        for index in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, index, now)
            if params.seed is not None:
                # distinct, reproducible streams for the n completions of one seeded request
                seq.generator = make_generator((params.seed + index * 0x9E3779B1) % (1 << 63), self.backend.device)
            seq.min_tokens_stop_ids = stop_ids if params.min_tokens else []
            seq.logprobs = [] if params.logprobs is not None else None
            seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
            seqs.append(seq)
        for seq in seqs:
            self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return seqs

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self._retire(seq, "abort")

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End one completion early (a stop string matched in the detokenizer)."""
        if not seq.is_finished:
            self._retire(seq, reason)
            seq.stop_reason = stop_reason

    def release_request(self, request_id: str) -> None:
        """Forget a finished request (its sequences are already freed)."""
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def shutdown(self) -> None:
        """Drop the model, its KV cache and graphs, and hand the device memory back to the device. Idempotent;
        the engine refuses new requests afterwards."""
        if self.runner is None:
            return
        if self._inflight is not None:
            self.backend.synchronize()  # a launched step still writes into the cache it is about to lose
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._inflight = self.last_batch = None
        self.runner = self.penalties = None
        # the runner and its graphs reference each other (the graphs replay the runner's bound forward)
        gc.collect()
        self.backend.empty_cache()

    @property
    def has_step_in_flight(self) -> bool:
        """A launched step whose tokens the next step() reads back (async scheduling)."""
        return self._inflight is not None

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that got a new token (finished ones included).

        With async scheduling (CUDA by default) a step launches batch N+1 before it reads batch N's
        sampled tokens back: the host's scheduling and input preparation overlap the GPU's work, decode
        rows take their input ids from N's sampled tensor on the device, and N's tokens are returned one
        call later. A sequence that stopped at N has one token computed in N+1 for nothing; it is dropped.
        Steps that need every earlier token on the host (pending min_tokens, prompt logprobs) run
        synchronously; penalties read token counts kept on the device (penalties.py) and overlap."""
        prev, self._inflight = self._inflight, None
        launched = None
        try:
            done = []
            if prev is not None and not self._can_overlap():
                done, prev = self._finish(prev), None     # schedule with every token known
            self.last_batch = batch = self.scheduler.schedule()   # the engine core reads it when a step fails
            launched = self._launch(batch, prev) if batch.seqs else None
            if prev is not None:
                done = self._finish(prev)
            if launched is not None and (not self.async_scheduling or launched.scoring):
                done += self._finish(launched)
            else:
                self._inflight = launched
                if launched is not None and prev is not None:
                    self.stats.overlapped_steps += 1
            return done
        except BaseException:   # nothing stays in flight: the failed step's requests are failed by the caller
            for step in (prev, launched):
                if step is not None:
                    for seq in step.sampling:
                        seq.num_inflight = 0
            self._inflight = None
            raise

    def _can_overlap(self) -> bool:
        """Whether the next batch may be sampled before the last one's tokens are on the host."""
        if not self.async_scheduling:
            return False
        for seq in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            params = seq.sampling_params
            if (params.min_tokens and seq.num_output_tokens + seq.num_inflight <= params.min_tokens) \
                    or (seq.prompt_logprobs is not None and seq.wants_prompt_logprobs):
                return False
        return True

    def _launch(self, batch: ScheduledBatch, prev: InFlightStep | None) -> InFlightStep:
        """Forward and sample ``batch`` without reading anything back to the host."""
        sampling = [batch.seqs[i] for i in batch.sample_indices]
        scoring, extra = prompt_logprob_rows(batch)
        previous = None
        if prev is not None and prev.out is not None:
            previous = (prev.out.token_ids, {seq.seq_id: i for i, seq in enumerate(prev.sampling)})
        logits = self.runner.run(batch, extra_indices=extra, previous_tokens=previous)
        if scoring:
            record_prompt_logprobs(batch, scoring, logits[len(sampling):])
            logits = logits[:len(sampling)]
        out = self.sampler(logits, sampling, history=self.penalties) if sampling else None
        readback = None
        if out is not None:   # queued now, so reading it back later does not wait for the next step
            wanted = [out.token_ids] if out.logprobs is None else [out.token_ids, out.logprobs, out.top_ids,
                                                                    out.top_logprobs]
            readback = self.backend.start_readback(wanted)
        self.scheduler.advance(batch)
        for seq in sampling:
            seq.num_inflight += 1
        return InFlightStep(sampling, out, readback, bool(scoring))

    def _finish(self, step: InFlightStep) -> list[Sequence]:
        """Read a launched step's tokens back (the one host transfer of a step) and apply them."""
        if step.readback is None:
            return []
        host = [t.tolist() for t in step.readback()]
        token_ids = host[0]
        if len(host) > 1:
            sampled_lp, top_ids, top_lp = host[1:]
        done = []
        for i, (seq, token) in enumerate(zip(step.sampling, token_ids)):
            seq.num_inflight -= 1
            if seq.is_finished:      # stopped (or aborted) while this step ran: its token is not wanted
                continue
            seq.append_token(token)
            if seq.logprobs is not None:
                k = seq.sampling_params.logprobs
                entry = {tid: Logprob(lp, rank) for rank, (tid, lp) in enumerate(zip(top_ids[i][:k], top_lp[i][:k]), 1)}
                entry.setdefault(token, Logprob(sampled_lp[i], None))
                seq.logprobs.append(entry)
            self._check_stop(seq, token)
            done.append(seq)
        self.stats.generated_tokens += len(done)
        return done

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Every way a sequence ends: the scheduler frees its blocks, the penalty history its row."""
        self.scheduler.finish(seq, reason)
        self.penalties.release(seq.seq_id)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self._retire(seq, "stop")
            if token in params.stop_token_ids:
                self._retire(seq, "stop")
                seq.stop_reason = token
                return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or len(seq.token_ids) >= self.max_model_len:
            self._retire(seq, "length")

    # -- scoring -----------------------------------------------------------------------------

    def prompt_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits at every position of each prompt, computed through the paged KV path in
        chunks of at most ``max_num_batched_tokens`` (so long prompts exercise chunked prefill)."""
        results = []
        bm = self.scheduler.block_manager
        budget = self.scheduler.config.max_num_batched_tokens
        for ids in prompts:
            seq = Sequence(next(self._seq_ids), "score", ids, SamplingParams())
            if not bm.grow(seq, seq.num_tokens):
                raise RuntimeError("not enough free KV blocks to score this prompt now")
            chunks = []
            try:
                while seq.num_computed_tokens < seq.num_tokens:
                    n = min(budget, seq.num_tokens - seq.num_computed_tokens)
                    chunks.append(self.runner.run(ScheduledBatch([seq], [n], n, 0), all_logits=True))
                    seq.num_computed_tokens += n
                    if seq.num_computed_tokens < seq.num_tokens:
                        self.stats.prefill_chunks += 1
            finally:
                bm.free(seq)
            results.append(torch.cat(chunks))
        return results
