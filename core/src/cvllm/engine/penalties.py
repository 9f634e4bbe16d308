"""Token history for repetition, presence and frequency penalties, kept on the device.

For each sequence with a penalty: how often every token occurred in its output (``counts``) and whether it
occurred in its prompt (``in_prompt``). A sequence gets a row the first time it samples, built once from
its token list on the host; from then on the sampler adds each token it samples on the device. So a step
with penalised rows needs no token list from the host and can be launched before the previous step's
tokens are read back (async scheduling), and no step copies whole token histories to the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from cvllm.engine.upload import upload


class PenalisedRow(Protocol):
    seq_id: int
    token_ids: list[int]        # prompt, then the output tokens read back so far
    num_prompt_tokens: int


def histories_from_token_lists(rows: Sequence[PenalisedRow], vocab_size: int, device: torch.device | str,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts [B, V] float32, seen [B, V] bool)`` of each row's tokens: output counts, and whether a token
    is in the prompt or the output (what ``PenaltyHistory.gather`` returns, from host lists)."""
    counts = torch.zeros(len(rows), vocab_size, device=device)
    in_prompt = torch.zeros(len(rows), vocab_size, device=device)
    _add_tokens(counts, in_prompt, torch.arange(len(rows)), rows)
    return counts, (in_prompt > 0) | (counts > 0)


def _add_tokens(counts: torch.Tensor, in_prompt: torch.Tensor, row_index: torch.Tensor,
                rows: Sequence[PenalisedRow]) -> None:
    """Count ``rows``' output tokens into ``counts[row_index[i]]`` and their prompt tokens into
    ``in_prompt[row_index[i]]`` (a count too: accumulating adds commute, so no write order matters), with one
    host-to-device copy of a flat (row, token, is_output) table."""
    lengths = torch.tensor([len(row.token_ids) for row in rows])
    tokens = torch.tensor([t for row in rows for t in row.token_ids], dtype=torch.long)
    which = torch.repeat_interleave(row_index.long().cpu(), lengths)
    first = torch.repeat_interleave(torch.tensor([row.num_prompt_tokens for row in rows]), lengths)
    position = torch.arange(len(tokens)) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    which, tokens, is_output = upload(torch.stack([which, tokens, (position >= first).long()]), counts.device)
    counts.index_put_((which, tokens), is_output.to(counts.dtype), accumulate=True)
    in_prompt.index_put_((which, tokens), (1 - is_output).to(in_prompt.dtype), accumulate=True)


class PenaltyHistory:
    """Rows of token history for the penalised sequences alive now, on ``device``; grows as needed."""

    def __init__(self, vocab_size: int, device: torch.device | str):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.counts = torch.zeros(0, vocab_size, device=self.device)
        # float32 counts (exact to 2^24): prompt occurrences only mark "seen", output ones also weigh
        self.in_prompt = torch.zeros(0, vocab_size, device=self.device)
        self._row_of: dict[int, int] = {}      # seq_id -> row
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._row_of)

    def rows(self, seqs: Sequence[PenalisedRow]) -> torch.Tensor:
        """Each sequence's row (int64, on the device); a sequence seen for the first time gets one, built from
        its token list, which must then hold all its tokens (none sampled but not read back yet)."""
        new = [seq for seq in seqs if seq.seq_id not in self._row_of]
        if new:
            for seq in new:
                if getattr(seq, "num_inflight", 0):
                    raise RuntimeError(f"sequence {seq.seq_id} gets its penalty history while a token is in flight")
            self._reserve(len(new))
            rows = [self._free.pop() for _ in new]
            self._row_of.update({seq.seq_id: row for seq, row in zip(new, rows)})
            index = upload(torch.tensor(rows), self.device)
            self.counts[index] = 0.0
            self.in_prompt[index] = 0.0
            _add_tokens(self.counts, self.in_prompt, torch.tensor(rows), new)
        return upload(torch.tensor([self._row_of[seq.seq_id] for seq in seqs]), self.device)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(counts [B, V], seen [B, V])`` of ``rows``: seen = in the prompt or the output so far."""
        counts = self.counts.index_select(0, rows)
        return counts, (self.in_prompt.index_select(0, rows) > 0) | (counts > 0)

    def record(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row (on the device: nothing waits for the sampling to finish)."""
        self.counts.index_put_((rows, token_ids), torch.ones((), device=self.device), accumulate=True)

    def release(self, seq_id: int) -> None:
        """A sequence has finished: its row is free (rebuilt from scratch when reused)."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    def _reserve(self, needed: int) -> None:
        if len(self._free) >= needed:
            return
        old = self.counts.shape[0]
        size = max(8, 2 * old, old + needed - len(self._free))
        counts = torch.zeros(size, self.vocab_size, device=self.device)
        in_prompt = torch.zeros(size, self.vocab_size, device=self.device)
        counts[:old], in_prompt[:old] = self.counts, self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(size - 1, old - 1, -1))
