"""The engine: ``step()`` = schedule, run, sample, postprocess (nano-vllm's shape)."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from cvllm.checkpoint.base import Checkpoint
from cvllm.engine.config import EngineConfig
from cvllm.engine.embedding import embed_all
from cvllm.engine.executor import Executor, LaunchedStep
from cvllm.engine.grammar_admission import GrammarAdmission
from cvllm.engine.observers import StepObservers, StepRecord
from cvllm.engine.request_checks import check_request
from cvllm.engine.sampler import advance_generator, make_generator
from cvllm.engine.scheduler import EngineStats, ScheduledBatch, Scheduler
from cvllm.engine.sequence import Sequence
from cvllm.engine.speculative import SpeculativeConfig
from cvllm.engine.speculator import Speculator
from cvllm.outputs import Logprob
from cvllm.pooling import PoolingConfig
from cvllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint, backend, dtype: torch.dtype, executor: Executor,
                 scheduler: Scheduler):
        """The assembled parts (build.py's ``build_engine`` assembles them from ``config``): the executor runs the
        batches the scheduler makes; ``checkpoint`` gives the tokenizer, the stop set and the vocabulary."""
        self.config = config
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.backend = backend
        self.dtype = dtype
        self.executor = executor
        self.scheduler = scheduler
        self.max_model_len = scheduler.config.max_model_len
        self.vocab_size = checkpoint.config.vocab_size
        self.eos_token_ids = checkpoint.eos_token_ids()
        self.requests: dict[str, list[Sequence]] = {}
        self.last_batch: ScheduledBatch | None = None
        # launch a step before reading the last one's tokens (see step()); the default overlaps on GPUs
        self.async_scheduling = backend.default_async_scheduling if config.async_scheduling is None \
            else config.async_scheduling
        self.observers = StepObservers()   # per-step records for metrics and benchmarks; none: no record is built
        self.fault_injector = config.fault_injector   # a test seam: it sees each scheduled batch, and may raise
        self._inflight: LaunchedStep | None = None
        speculative = SpeculativeConfig.from_dict(config.speculative_config)
        # n-gram or draft-model drafts verified in one forward (speculative.py); None: off
        self.speculator = None if speculative is None else Speculator(
            speculative, scheduler, self.max_model_len, executor.propose_drafts if executor.draft else None,
            backend.draft_token_cost)
        if speculative is not None:
            self._enable_device_drafts(speculative)
        # structured requests wait here while their grammars compile
        self.grammar_admission = GrammarAdmission(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                  scheduler.config.max_num_seqs)
        self._shut_down = False
        self._seq_ids = itertools.count()

    def _enable_device_drafts(self, spec: SpeculativeConfig) -> None:
        """N-gram drafts looked up on the device (ngram_device.py), where asked (else the backend's default) and
        possible: async scheduling, and an executor that can."""
        wanted = spec.device_drafts if spec.device_drafts is not None else self.backend.device_drafts
        if not wanted or spec.method != "ngram":
            return
        if not (self.async_scheduling and self.executor.supports_device_drafts):
            if spec.device_drafts:
                logger.warning("speculative_config device_drafts: not used (it needs async scheduling, one worker "
                               "and a model whose attention reads sequence lengths on the device)")
            return
        self.executor.enable_device_drafts(spec.disable_by_batch_size, self.max_model_len, spec.prompt_lookup_min,
                                           spec.prompt_lookup_max)
        self.speculator.device_drafts = True

    @property
    def runner(self):
        """The in-process worker's model runner (tests and benchmarks inspect its model, cache and graphs)."""
        return self.executor.runner

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def grammars(self):
        """Structured output's GrammarMasks (None before the first structured request)."""
        return self.grammar_admission.masks

    # -- requests ----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    resumed: dict[int, list[int]] | None = None) -> list[Sequence]:
        """``resumed``: a request carried over from an engine core that died (server/supervisor.py): by completion
        index, the output tokens it had generated (``Sequence.resume``); completions not in it had ended."""
        if self._shut_down:
            raise RuntimeError("this engine was shut down: its model and KV cache are freed")
        if request_id in self.requests:
            raise ValueError(f"request id '{request_id}' is already in use")
        check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        stop_ids = sorted((set() if params.ignore_eos else self.eos_token_ids) | set(params.stop_token_ids))
        now = time.monotonic()
        seqs = []
        for index in range(params.n):
            if resumed is not None and index not in resumed:
                continue
            seq = Sequence(next(self._seq_ids), request_id, prompt_token_ids, params, index, now)
            if params.seed is not None:
                # distinct, reproducible streams for the n completions of one seeded request
                seq.generator = make_generator((params.seed + index * 0x9E3779B1) % (1 << 63), self.backend.device)
            seq.min_tokens_stop_ids = stop_ids if params.min_tokens else []
            seq.logprobs = [] if params.logprobs is not None else None
            seq.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
            if resumed is not None:
                seq.resume(resumed[index])
                if seq.generator is not None and not params.greedy and self.speculator is None:
                    advance_generator(seq.generator, seq.num_output_tokens, self.vocab_size)
            seqs.append(seq)
        if params.structured_outputs is not None:
            self.grammar_admission.submit(params.structured_outputs, seqs)
        else:
            for seq in seqs:
                self.scheduler.add(seq)
        self.requests[request_id] = seqs
        return seqs

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self._retire(seq, "abort")

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End one completion early: the output processor matched a stop string, or its request asked to stop it."""
        if not seq.is_finished:
            self._retire(seq, reason)
            seq.stop_reason = stop_reason

    def release_request(self, request_id: str) -> None:
        """Forget a finished request (its sequences are already freed)."""
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or self._inflight is not None
                or bool(self.grammar_admission.compiling))

    def shutdown(self) -> None:
        """Drop the model, its KV cache and graphs, and hand the device memory back to the device. Idempotent;
        the engine refuses new requests afterwards."""
        if self._shut_down:
            return
        if self._inflight is not None:
            self.executor.synchronize()  # a launched step still writes into the cache it is about to lose
        for request_id in list(self.requests):
            self.abort_request(request_id)
        self._inflight = self.last_batch = None
        self._shut_down = True
        self.grammar_admission.shutdown()
        self.executor.shutdown()

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
        synchronously; penalties read token counts kept on the device (penalties.py) and overlap. With n-gram
        speculation, N+1 is launched on a guess of N's outcome, checked when N is read back (speculator.py).

        With an observer registered, the step's StepRecord (batch shape, host phases) goes to it at the end."""
        record = self.observers.start() if self.observers.active else None
        prev, self._inflight = self._inflight, None
        launched = None
        try:
            done = self.grammar_admission.admit(prev is None and not self.scheduler.has_unfinished(),
                                                self.scheduler.add, self._retire)
            if prev is not None and not self._can_overlap(prev):
                done, prev = done + self._finish(prev, record), None     # schedule with every token known
            batch = self._schedule()
            if not batch.seqs and prev is not None:
                # nothing could run beside the step in flight (the speculator held every sequence for its outcome):
                # read it back and schedule again here, so that the next step is launched before the caller handles
                # this one's tokens (detokenizing, streaming) instead of after: for a synchronous verify step that
                # work would otherwise sit between two device steps
                done, prev = done + self._finish(prev, record), None
                batch = self._schedule()
            if self.fault_injector is not None:
                self.fault_injector(batch)
            if record is not None:
                record.scheduled(batch)
            overlapped = False
            if batch.seqs:
                launched, finished = self._launch(batch, prev, record)
                overlapped = prev is not None   # launched before the last step's tokens were read
                self.stats.spec_lagged_steps += batch.lagged
                if finished is not None:
                    done, prev = done + finished, None
            if prev is not None:
                done += self._finish(prev, record)
            if launched is not None and (not self.async_scheduling or launched.scoring
                                         or (launched.speculative and not self.speculator.overlaps)):
                done += self._finish(launched, record)
            else:
                self._inflight = launched
                if overlapped:
                    self.stats.overlapped_steps += 1
        except BaseException:   # nothing stays in flight: the failed step's requests are failed by the caller
            for step in (prev, launched):
                if step is not None:
                    for seq in step.sampling:
                        seq.num_inflight = 0
            self._inflight = None
            if self.speculator is not None:
                self.speculator.reset()
            raise
        if record is not None:   # outside the try: the step itself succeeded, whatever an observer does
            self.observers.send(record, len(done))
        return done

    def _schedule(self) -> ScheduledBatch:
        """The next batch, drafts proposed and fitted to it."""
        if self.speculator is not None:
            self.speculator.propose()
        self.last_batch = batch = self.scheduler.schedule()   # the engine core reads it when a step fails
        if self.speculator is not None:
            self.speculator.fit(batch)
        return batch

    def _can_overlap(self, prev: LaunchedStep) -> bool:
        """Whether the next batch may be sampled before ``prev``'s tokens are on the host (with speculation: set up
        on a guess of ``prev``'s outcome)."""
        if not self.async_scheduling:
            return False
        for seq in itertools.chain(self.scheduler.running, self.scheduler.waiting):
            params = seq.sampling_params
            if (params.min_tokens and seq.num_output_tokens + seq.num_inflight <= params.min_tokens) \
                    or (seq.prompt_logprobs is not None and seq.wants_prompt_logprobs):
                return False
        return self.speculator is None or self.speculator.guess(prev)

    def _launch(self, batch: ScheduledBatch, prev: LaunchedStep | None,
                record: StepRecord | None) -> tuple[LaunchedStep, list[Sequence] | None]:
        """Forward and sample ``batch`` without reading anything back to the host. Where its sampling rows have
        grammars, sampling waits for their masks: the forward pass is launched first, then ``prev``'s tokens are
        read back and fed to the matchers, and the masks computed, while the device runs the forward (async
        scheduling's overlap kept; the unconstrained rows are sampled with them). Returns the launched step, and
        ``prev``'s finished sequences where it was read back here (else None)."""
        structured = self.grammars is not None and any(batch.seqs[i].grammar is not None
                                                       for i in batch.sample_indices)
        forwarded = self.executor.forward(batch, prev, record) if structured else None
        step = None if structured else self.executor.execute(batch, prev, record)
        if step is not None and self.speculator is not None:
            self.speculator.detach(step)   # drafts and guessed tokens off the sequences before blocks are cached
        self.scheduler.advance(batch)
        sampling = forwarded.sampling if structured else step.sampling
        for seq in sampling:
            seq.num_inflight += 1
        finished = None
        if structured:
            if prev is not None:
                finished = self._finish(prev, record)
            step = self.executor.sample(forwarded, self.grammars.bitmask(forwarded.sampler_rows()), record)
            if self.speculator is not None:
                self.speculator.detach(step)
        if record is not None:
            record.mark("advance")
        return step, finished

    def _finish(self, step: LaunchedStep, record: StepRecord | None) -> list[Sequence]:
        """Read a launched step's tokens back (the one host transfer of a step) and apply them."""
        if step.readback is None:
            return []
        host = [t.tolist() for t in step.readback()]
        if step.feed is not None:   # the drafts it verified, which the device looked up (ngram_device.py)
            flat, k = host.pop(), step.num_drafts[0]
            step.drafts = [flat[i:i + k] for i in range(0, len(flat), k)]
        if record is not None:
            record.mark("wait")
        token_ids = host[0]
        if len(host) > 1:
            sampled_lp, top_ids, top_lp = host[1:]
        done = []
        generated = 0
        not_finite = bool(token_ids) and min(token_ids) < 0   # some row's logits were NaN or +inf (sampler.py)
        for seq, first, end, drafts in step.rows():   # a speculating sequence has 1 + K rows, the others one
            if seq.seq_id in step.void:   # launched on a wrong guess (speculator.py): nothing to read
                continue
            seq.num_inflight -= 1
            tokens = token_ids[first:end]
            if not_finite and min(tokens) < 0:   # its logits held NaN or +inf (sampler.py): it fails, others go on
                if not seq.is_finished:
                    logger.error("request %s: the model's logits are not finite; failing it", seq.request_id)
                    self._retire(seq, "error")
                    done.append(seq)
                if self.speculator is not None:
                    self.speculator.forget(seq)
                continue
            if self.speculator is not None:
                tokens = self.speculator.settle(seq, drafts, tokens)
            if seq.is_finished:      # stopped (or aborted) while this step ran: its tokens are not wanted
                continue
            for i, token in enumerate(tokens, first):
                seq.append_token(token)
                generated += 1
                if seq.grammar is not None and not seq.grammar.accept(token, seq):
                    # (not reached: the mask allows only what the grammar accepts)
                    logger.error("request %s: %s; ending it", seq.request_id, seq.grammar.error())
                    self._retire(seq, "stop")
                    break
                if seq.logprobs is not None:
                    k = seq.sampling_params.logprobs
                    entry = {tid: Logprob(lp, rank)
                             for rank, (tid, lp) in enumerate(zip(top_ids[i][:k], top_lp[i][:k]), 1)}
                    entry.setdefault(token, Logprob(sampled_lp[i], None))
                    seq.logprobs.append(entry)
                self._check_stop(seq, token)
                if seq.is_finished:   # a stop among accepted drafts: the tokens after it are dropped
                    break
            done.append(seq)
        self.stats.generated_tokens += generated
        if record is not None:
            record.mark("finish")
        return done

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Every way a sequence ends: the scheduler frees its blocks, the executor its device state (penalties)."""
        self.scheduler.finish(seq, reason)
        self.executor.release(seq.seq_id)

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
                    chunks.append(self.executor.prompt_logits(ScheduledBatch([seq], [n], n, 0)))
                    seq.num_computed_tokens += n
                    if seq.num_computed_tokens < seq.num_tokens:
                        self.stats.prefill_chunks += 1
            finally:
                bm.free(seq)
            results.append(torch.cat(chunks))
        return results

    # -- embeddings --------------------------------------------------------------------------

    def embed(self, prompts: list[list[int]], pooling: PoolingConfig | None = None,
              dimensions: int | None = None) -> list[torch.Tensor]:
        """One fp32 vector per prompt: the final hidden states (after the model's last norm, before the LM head)
        pooled as ``pooling`` says (default: what the checkpoint declares, else last-token, L2-normalised), cut to
        ``dimensions`` (Matryoshka). Runs through the paged prefill path in chunks of at most
        ``max_num_batched_tokens`` and frees every block it took (engine/embedding.py); with nothing else running:
        the engine core interleaves an ``Embedder`` with its steps instead."""
        if self._shut_down:
            raise RuntimeError("this engine was shut down: its model and KV cache are freed")
        return embed_all(self, prompts, pooling or self.checkpoint.pooling or PoolingConfig(), dimensions)
