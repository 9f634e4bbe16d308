"""Continuous batching with one token budget per step (pure Python, no torch).

Each step, running sequences go first (a decode takes one token, an unfinished prefill its next
chunk), then waiting sequences are admitted while budget, ``max_num_seqs`` and KV blocks allow.
So one step can mix prefill chunks and decodes. When blocks run out, the newest running
sequence is preempted: its blocks are freed and it is recomputed later (prefix caching often
makes that recompute cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cvllm.engine.block_manager import BlockManager
from cvllm.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048   # token budget per step
    max_model_len: int = 2048
    prefill_chunk_size: int = 0          # most tokens one prompt computes per step (0: the budget)


@dataclass(slots=True)
class EngineStats:
    """Counters that show which mechanisms fired (tests and /metrics read them)."""

    steps: int = 0
    prefill_chunks: int = 0       # prefill chunks that did not finish their prompt
    mixed_steps: int = 0          # steps that ran a prefill chunk and a decode together
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    overlapped_steps: int = 0     # steps launched before the previous step's tokens were read back
    spec_draft_tokens: int = 0    # speculative decoding: drafts verified, and accepted
    spec_accepted_tokens: int = 0
    spec_verifications: int = 0   # sequence-steps that verified drafts
    spec_guesses: int = 0         # steps launched before the verify step they follow was read back (per sequence)
    spec_guess_misses: int = 0    # ... whose guess of its outcome was wrong (their rows were void)
    spec_lagged_steps: int = 0    # verify steps launched a step behind on inputs the device computed (no guess)


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # new tokens each sequence computes this step
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    # the sequences that reach their last token this step (their logits are sampled); fixed when scheduled
    sample_indices: list[int] = field(default_factory=list)
    num_draft_chunk_tokens: int = 0   # tokens of decodes with drafts (speculative), in num_prefill_tokens
    # every sequence verifies K drafts and the device computes the next step's inputs (ngram_device.py) ...
    device_drafts: bool = False
    # ... and this step's came from there: built a step behind, launched before the one before it was read back
    lagged: bool = False

    def __len__(self) -> int:
        return len(self.seqs)

    def samples(self, i: int) -> bool:
        """Whether sequence ``i`` reaches its last token this step, so its logits are sampled."""
        return i in self.sample_indices


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()

    def add(self, seq: Sequence) -> None:
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(f"prompt of {seq.num_tokens} tokens is longer than the maximum model length "
                             f"{self.config.max_model_len}")
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.config.prefill_chunk_size:
            n = min(n, self.config.prefill_chunk_size)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:   # it waits for the step in flight (speculator.py's hold)
                i += 1
                continue
            while not bm.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]   # newest first; never one already scheduled (they sit before i)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self._add(batch, seq, n)
                budget -= n
                i += 1

        # Admit new work only when nothing had to be preempted this step (it would just thrash).
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = 0
            if not seq.block_table and not seq.wants_prompt_logprobs:
                hit = bm.allocate_cached_prefix(seq)
                seq.num_computed_tokens = hit
            n = self._chunk(seq, budget)
            if not bm.grow(seq, seq.num_computed_tokens + n):
                bm.free(seq)
                seq.num_computed_tokens = 0
                break
            self.stats.prefix_hit_tokens += hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = hit
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n

        if batch.seqs:
            self.stats.steps += 1
            if batch.num_decodes and batch.num_prefill_tokens:
                self.stats.mixed_steps += 1
        return batch

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        if seq.num_computed_tokens + n == seq.num_tokens:
            batch.sample_indices.append(len(batch.seqs))
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        is_decode = n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        if is_decode:
            batch.num_decodes += 1
        else:   # (a decode with drafts too: several query tokens, so the varlen path)
            batch.num_prefill_tokens += n
            if seq.num_drafts:
                batch.num_draft_chunk_tokens += n
            elif seq.num_computed_tokens + n < seq.num_tokens:
                self.stats.prefill_chunks += 1

    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the scheduled tokens are in the cache now."""
        for seq, n in zip(batch.seqs, batch.num_tokens):
            # drafts count once verified (the engine adds the accepted ones): no prefix-cache block holds a
            # token that may be rejected
            seq.num_computed_tokens += n - seq.num_drafts
            seq.num_drafts = 0   # (the launched step keeps them: executor.py's LaunchedStep)
            self.block_manager.cache_full_blocks(seq)
        self.stats.prompt_tokens_computed += batch.num_prefill_tokens - batch.num_draft_chunk_tokens

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) wherever it is and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
