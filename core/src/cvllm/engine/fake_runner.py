"""A model runner without a model: each step costs a fixed time and yields fixed logits.

For measuring everything around the model (scheduler, IPC, detokenization, HTTP) at a load the
real model could not produce on the same machine. The KV pool is bookkeeping only.
"""

from __future__ import annotations

import time

import torch

from cvllm.engine.scheduler import ScheduledBatch


class FakeModelRunner:
    def __init__(self, vocab_size: int, block_size: int, step_seconds: float, avoid_ids: set[int]):
        self.block_size = block_size
        self.step_seconds = step_seconds
        self.num_blocks = 0
        self.vocab_size = vocab_size
        # cycle through ordinary tokens so detokenization does real work; never an EOS id. The upper half
        # of a BPE vocabulary holds merged, whole-character pieces (low ids can be lone UTF-8 bytes).
        first = vocab_size // 2
        self.token_cycle = torch.tensor([t for t in range(first, min(vocab_size, first + 1000)) if t not in avoid_ids]
                                        or [vocab_size - 1])
        self._logits = torch.zeros(0, vocab_size)
        self._step = 0

    def kv_bytes_per_block(self) -> int:
        return 1

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def run(self, batch: ScheduledBatch, all_logits: bool = False, extra_indices=None,
            previous_tokens=None) -> torch.Tensor:
        """ModelRunner.run's signature; the fixed logits depend on no input (previous_tokens included)."""
        return self.forward(batch, self.prepare(batch, previous_tokens), all_logits, extra_indices)

    def prepare(self, batch: ScheduledBatch, previous_tokens=None) -> None:
        """No inputs to build: the logits depend on none."""

    def forward(self, batch: ScheduledBatch, inputs: None, all_logits: bool = False,
                extra_indices=None) -> torch.Tensor:
        started = time.perf_counter()
        # a sampled row per sequence, and one per draft a speculating sequence verifies (executor.ForwardedStep)
        rows = sum(batch.num_tokens) if all_logits else sum(1 + batch.seqs[i].num_drafts for i in batch.sample_indices)
        rows += 0 if extra_indices is None else len(extra_indices)
        if self._logits.shape[0] < rows:
            self._logits = torch.zeros(max(rows, 2 * self._logits.shape[0]), self.vocab_size)
        logits = self._logits[:rows]
        logits.zero_()
        picks = self.token_cycle[(torch.arange(rows) + self._step) % len(self.token_cycle)]
        logits[torch.arange(rows), picks] = 10.0
        self._step += 1
        remaining = self.step_seconds - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return logits
