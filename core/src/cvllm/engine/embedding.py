"""Embeddings through the engine's prefill path: a small scheduler of its own beside the generation one.

Each input becomes a Sequence that holds KV blocks only while it is computed: its prompt runs in chunks (a later
chunk attends to the earlier ones' KV, as a generation prefill does), the hidden states of each chunk are pooled as
they come (mean pooling needs every chunk's), and its blocks are freed when its last chunk has run, so no KV cache
is left behind. ``step()`` runs one forward pass of at most ``max_num_batched_tokens`` tokens over the inputs of
every queued request (inputs of several requests share a pass), so the engine core can alternate it with
generation steps: a long embedding request slows generation down, it never stalls it. An input starts only when
free blocks hold it whole; the ones that started always finish (they hold their blocks), so nothing deadlocks; and
while generation requests wait to be admitted, new inputs start only once the running ones are done.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.sequence import Sequence
from cvllm.pooling import PoolingConfig, check_dimensions
from cvllm.sampling_params import SamplingParams

_NO_SAMPLING = SamplingParams()


@dataclass(eq=False)
class EmbeddingJob:
    """One request: its inputs, how to pool them, and the vectors (fp32, on the host) as they finish."""
    request_id: str
    prompts: list[list[int]]
    pooling: PoolingConfig
    dimensions: int | None
    vectors: list[torch.Tensor | None] = field(default_factory=list)
    started: int = 0       # inputs given blocks so far (they start in order)
    remaining: int = 0     # inputs not finished

    @property
    def done(self) -> bool:
        return self.remaining == 0


@dataclass(eq=False)
class _Input:
    job: EmbeddingJob
    index: int
    seq: Sequence
    pooled: torch.Tensor | None = None   # the running sum (mean), the first token's (cls) or last token's state


class Embedder:
    def __init__(self, engine):
        self.engine = engine
        self.block_manager = engine.scheduler.block_manager
        self.jobs: deque[EmbeddingJob] = deque()
        self.running: list[_Input] = []
        self.last_request_ids: list[str] = []   # the requests of the last forward pass (the ones to fail if it raised)
        self._seq_ids = itertools.count(-1, -1)   # negative: never a generation sequence's id

    def add(self, request_id: str, prompts: list[list[int]], pooling: PoolingConfig,
            dimensions: int | None = None) -> EmbeddingJob:
        """Queue a request; raises ValueError for an input the model cannot take."""
        engine = self.engine
        if not prompts:
            raise ValueError("the input is empty")
        for ids in prompts:
            if not ids:
                raise ValueError("an input is empty")
            if min(ids) < 0 or max(ids) >= engine.vocab_size:
                raise ValueError(f"input token ids must be in [0, {engine.vocab_size})")
            if len(ids) > engine.max_model_len:
                raise ValueError(f"an input has {len(ids)} tokens, more than the maximum model length "
                                 f"{engine.max_model_len}")
        config = engine.checkpoint.config
        check_dimensions(dimensions, config.hidden_size, config.get("matryoshka_dimensions"))
        if any(job.request_id == request_id for job in self.jobs):
            raise ValueError(f"request id '{request_id}' is already in use")
        job = EmbeddingJob(request_id, [list(ids) for ids in prompts], pooling, dimensions,
                           [None] * len(prompts), remaining=len(prompts))
        self.jobs.append(job)
        return job

    def has_work(self) -> bool:
        return bool(self.jobs)

    def abort(self, request_id: str) -> None:
        for job in [job for job in self.jobs if job.request_id == request_id]:
            self._drop(job)

    def _drop(self, job: EmbeddingJob) -> None:
        for item in [item for item in self.running if item.job is job]:
            self.block_manager.free(item.seq)
            self.running.remove(item)
        self.jobs.remove(job)

    def step(self) -> list[EmbeddingJob] | None:
        """One forward pass; returns the requests it finished, or None when no input could run (every one waits
        for free KV blocks). If the pass raises, its requests are dropped (``last_request_ids`` names them)."""
        batch = self._schedule()
        if batch is None:
            return None
        items, counts = batch
        self.last_request_ids = sorted({item.job.request_id for item in items})
        try:
            hidden = self.engine.executor.prompt_hidden(ScheduledBatch([item.seq for item in items], counts,
                                                                       sum(counts), 0))
            self._pool(items, counts, hidden)
        except BaseException:
            for job in {item.job for item in items}:
                self._drop(job)
            raise
        finished = [job for job in self.jobs if job.done]
        for job in finished:
            self.jobs.remove(job)
        return finished

    def _schedule(self) -> tuple[list[_Input], list[int]] | None:
        """The running inputs' next chunks first (they hold blocks), then new inputs in request order while the
        token budget, ``max_num_seqs`` and the free blocks allow."""
        config = self.engine.scheduler.config
        budget, rows = config.max_num_batched_tokens, config.max_num_seqs
        items, counts = [], []
        for item in self.running:
            if budget == 0 or len(items) == rows:
                break
            n = min(budget, item.seq.num_tokens - item.seq.num_computed_tokens)
            items.append(item)
            counts.append(n)
            budget -= n
        if self.running and self.engine.scheduler.waiting:
            # generation is queued (often for blocks): no input starts beside running ones, so the blocks they free
            # go to the generation step that follows this pass, and a stream of embeddings cannot starve it
            return (items, counts) if items else None
        for job in self.jobs:
            while job.started < len(job.prompts) and budget > 0 and len(items) < rows:
                seq = Sequence(next(self._seq_ids), job.request_id, job.prompts[job.started], _NO_SAMPLING)
                if not self.block_manager.grow(seq, seq.num_tokens):
                    return (items, counts) if items else None   # later inputs wait: they start in order
                item = _Input(job, job.started, seq)
                job.started += 1
                self.running.append(item)
                n = min(budget, seq.num_tokens)
                items.append(item)
                counts.append(n)
                budget -= n
        return (items, counts) if items else None

    def _pool(self, items: list[_Input], counts: list[int], hidden: torch.Tensor) -> None:
        start = 0
        for item, n in zip(items, counts):
            rows, seq = hidden[start:start + n], item.seq
            start += n
            method = item.job.pooling.method
            if method == "mean":
                total = rows.float().sum(0)
                item.pooled = total if item.pooled is None else item.pooled + total
            elif method == "cls" and seq.num_computed_tokens == 0:
                item.pooled = rows[0].float()
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            if method == "last":
                item.pooled = rows[-1].float()
            elif method == "mean":
                item.pooled = item.pooled / seq.num_tokens
            self.block_manager.free(seq)
            self.running.remove(item)
            job = item.job
            job.vectors[item.index] = finish_vector(item.pooled, job.pooling.normalize, job.dimensions)
            job.remaining -= 1


def finish_vector(pooled: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation, then L2 normalisation (of the truncated vector: a prefix of a unit vector is not
    one); fp32 on the host."""
    if dimensions is not None:
        pooled = pooled[:dimensions]
    if normalize:
        pooled = torch.nn.functional.normalize(pooled, p=2, dim=0)
    return pooled.float().cpu()


def embed_all(engine, prompts: list[list[int]], pooling: PoolingConfig, dimensions: int | None = None
              ) -> list[torch.Tensor]:
    """Every input's vector, with nothing else running (the offline API)."""
    embedder = Embedder(engine)
    job = embedder.add("embed", prompts, pooling, dimensions)
    while not job.done:
        if embedder.step() is None:
            raise RuntimeError("not enough free KV blocks to embed this input now")
    return job.vectors
