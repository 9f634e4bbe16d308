"""The engine: ``step()`` = schedule, run, sample, postprocess (nano-vllm's shape)."""

from __future__ import annotations

import itertools
import logging
import time

import torch

from cvllm import plugins
from cvllm.checkpoint.base import Checkpoint
from cvllm.config import resolve_dtype
from cvllm.engine.block_manager import BlockManager
from cvllm.engine.config import EngineConfig
from cvllm.engine.fake_runner import FakeModelRunner
from cvllm.engine.model_runner import ModelRunner, build_model
from cvllm.engine.sampler import make_generator
from cvllm.engine.scheduler import EngineStats, ScheduledBatch, Scheduler, SchedulerConfig
from cvllm.engine.sequence import Sequence
from cvllm.outputs import Logprob
from cvllm.sampling_params import SamplingParams

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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # a path (opened by whichever plugin claims it), or a Checkpoint built in memory (benchmarks' random weights)
        model = config.model
        self.checkpoint = model if isinstance(model, Checkpoint) else plugins.open_checkpoint(model)
        self.tokenizer = self.checkpoint.tokenizer
        self.backend = select_backend(config.backend)
        self.dtype = resolve_dtype(config.dtype, self.checkpoint.config)
        if config.fake_step_ms is not None:
            self.runner = FakeModelRunner(self.checkpoint.config.vocab_size, config.block_size,
                                          config.fake_step_ms / 1000, self.checkpoint.eos_token_ids())
        else:
            model = build_model(self.checkpoint, self.backend, self.dtype, isq=config.isq)
            self.runner = ModelRunner(model, self.backend, config.block_size, self.dtype)

        model_config = self.checkpoint.config
        context_len = model_config.get("max_position_embeddings") or 2048
        max_model_len = config.max_model_len or context_len
        if max_model_len > context_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"(max_position_embeddings = {context_len})")
        max_num_seqs = config.max_num_seqs or getattr(self.backend, "default_max_num_seqs", 16)
        num_blocks = self._kv_blocks(max_model_len, max_num_seqs)
        self.runner.allocate_kv_cache(num_blocks)
        if num_blocks * config.block_size < max_model_len:
            logger.warning("max_model_len %d capped to %d: the KV pool holds only %d blocks",
                           max_model_len, num_blocks * config.block_size, num_blocks)
            max_model_len = num_blocks * config.block_size
        self.max_model_len = max_model_len
        if not config.enforce_eager and config.fake_step_ms is None:
            self.runner.enable_decode_graphs(max_num_seqs, max_model_len)
        budget = config.max_num_batched_tokens or getattr(self.backend, "default_max_num_batched_tokens", 2048)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                            max_model_len=max_model_len, prefill_chunk_size=config.prefill_chunk_size),
            BlockManager(num_blocks, config.block_size, config.enable_prefix_caching))
        self.sampler = plugins.samplers().get("default")()   # the built-in registers it like any plugin
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self.requests: dict[str, list[Sequence]] = {}
        self.last_batch: ScheduledBatch | None = None
        self._seq_ids = itertools.count()
        torch.manual_seed(config.seed)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens), max_model_len %d, backend %s, dtype %s",
                    num_blocks, config.block_size, num_blocks * config.block_size, max_model_len,
                    self.backend.name, self.dtype)

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
                self.scheduler.finish(seq, "abort")

    def finish_sequence(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End one completion early (a stop string matched in the detokenizer)."""
        if not seq.is_finished:
            self.scheduler.finish(seq, reason)
            seq.stop_reason = stop_reason

    def release_request(self, request_id: str) -> None:
        """Forget a finished request (its sequences are already freed)."""
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ----------------------------------------------------------------------------

    def step(self) -> list[Sequence]:
        """Run one batch; returns the sequences that got a new token (finished ones included)."""
        self.last_batch = batch = self.scheduler.schedule()   # the engine core reads it when a step fails
        if not batch.seqs:
            return []
        sampling = [batch.seqs[i] for i in batch.sample_indices]
        scoring, extra = self._prompt_logprob_rows(batch)
        logits = self.runner.run(batch, extra_indices=extra)
        if scoring:
            self._record_prompt_logprobs(batch, scoring, logits[len(sampling):])
            logits = logits[:len(sampling)]
        out = self.sampler(logits, sampling) if sampling else None
        self.scheduler.advance(batch)
        if out is None:
            return []
        self._postprocess(sampling, out)
        return sampling

    @staticmethod
    def _prompt_logprob_rows(batch: ScheduledBatch) -> tuple[list[int], torch.Tensor | None]:
        """Which scheduled sequences need prompt logprobs, and their rows in the flat batch."""
        scoring = [i for i, seq in enumerate(batch.seqs) if seq.wants_prompt_logprobs]
        if not scoring:
            return [], None
        starts = [0, *itertools.accumulate(batch.num_tokens)]
        return scoring, torch.cat([torch.arange(starts[i], starts[i + 1]) for i in scoring])

    def _record_prompt_logprobs(self, batch: ScheduledBatch, scoring: list[int], logits: torch.Tensor) -> None:
        """The logits at position a score prompt token a + 1; entries are appended in order, so a
        sequence recomputed after preemption does not record a position twice."""
        offset = 0
        for i in scoring:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            rows = logits[offset:offset + n]
            offset += n
            first = seq.num_computed_tokens              # absolute position of rows[0]
            targets = range(max(first + 1, len(seq.prompt_logprobs)), min(first + n + 1, seq.num_prompt_tokens))
            if not targets:
                continue
            rows = rows[targets.start - 1 - first: targets.stop - 1 - first].log_softmax(dim=-1)
            ids = torch.tensor(seq.token_ids[targets.start:targets.stop], device=rows.device)
            chosen = rows.gather(1, ids[:, None])[:, 0].tolist()
            k = seq.sampling_params.prompt_logprobs
            top_lp, top_ids = rows.topk(k, dim=-1) if k else (rows[:, :0], rows[:, :0].long())
            for token, lp, t_ids, t_lps in zip(ids.tolist(), chosen, top_ids.tolist(), top_lp.tolist()):
                entry = {tid: Logprob(v, rank) for rank, (tid, v) in enumerate(zip(t_ids, t_lps), 1)}
                entry.setdefault(token, Logprob(lp, None))
                seq.prompt_logprobs.append(entry)

    def _postprocess(self, seqs: list[Sequence], out) -> None:
        token_ids = out.token_ids.tolist()  # the one host transfer of the step
        if out.logprobs is not None:
            sampled_lp, top_ids, top_lp = out.logprobs.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
        for i, (seq, token) in enumerate(zip(seqs, token_ids)):
            seq.append_token(token)
            if seq.logprobs is not None:
                k = seq.sampling_params.logprobs
                entry = {tid: Logprob(lp, rank) for rank, (tid, lp) in enumerate(zip(top_ids[i][:k], top_lp[i][:k]), 1)}
                entry.setdefault(token, Logprob(sampled_lp[i], None))
                seq.logprobs.append(entry)
            self._check_stop(seq, token)
        self.stats.generated_tokens += len(seqs)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return self.scheduler.finish(seq, "stop")
            if token in params.stop_token_ids:
                self.scheduler.finish(seq, "stop")
                seq.stop_reason = token
                return
        if (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens) \
                or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

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
