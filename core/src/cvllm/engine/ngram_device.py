"""N-gram drafting on the device: a verify step's outcome and the next step's drafts computed where the tokens are.

With async scheduling the host launches step t + 1 before it reads step t back. A verify step yields 1..K + 1 tokens,
so the host cannot know t + 1's inputs (its first token, its positions, its drafts). Here the device does: right
after t is sampled, ``advance_ngram`` counts t's accepted drafts, appends t's new tokens to the sequence's token
history kept on the device, looks the next K drafts up in it (the host's ``speculative.lookup_ngram``, the same
drafts), and leaves t + 1's input ids and positions for ``lagged_fixup`` to put in place when t + 1 is prepared.
The host builds t + 1 one step behind (as if t had accepted nothing) and reads t back afterwards, as plain async
decoding does (speculator.py's ``lag``; docs/speculative.md, "Drafts on the device").

Every such step verifies exactly K drafts a sequence (the graphs' shape is fixed by it): where the lookup finds
fewer, or none, the rest repeat the sequence's last token (``pad_drafts``, the host's side of the same rule). Any
drafts that depend only on the tokens before them keep the output exact (speculative.py), these too.

The functions here are torch ops on whatever device the tensors are on; a backend may replace ``advance_ngram`` with
one kernel (``Backend.advance_ngram``: CUDA's Triton kernel, the CPU's ``advance_ngram_host``).
"""

from __future__ import annotations

import torch

from cvllm.engine.speculative import accepted, lookup_ngram
from cvllm.engine.upload import upload


def pad_drafts(drafts: list[int], last_token: int, k: int) -> list[int]:
    """``drafts`` made exactly ``k`` long: the lookup's, then the sequence's last token repeated (what the device's
    lookup gives where the match runs into the end of the sequence or nothing matched)."""
    return drafts[:k] + [last_token] * (k - len(drafts))


class NgramHistory:
    """Each drafting sequence's verified tokens on the device, a row of ``history`` each, ``lengths`` long."""

    def __init__(self, num_rows: int, max_len: int, device: torch.device):
        self.history = torch.zeros(num_rows, max_len, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(num_rows, dtype=torch.int64, device=device)
        self.rows: dict[int, int] = {}   # seq_id -> its row
        self.free = list(range(num_rows - 1, -1, -1))
        self._uploaded: tuple[tuple[int, ...], torch.Tensor] = ((), self.lengths[:0])

    def rows_tensor(self, seq_ids: list[int]) -> torch.Tensor:
        """The rows of ``seq_ids`` on the device (uploaded again only when they change: most steps' are the last's)."""
        rows = tuple(self.rows[seq_id] for seq_id in seq_ids)
        if rows != self._uploaded[0]:
            self._uploaded = (rows, upload(torch.tensor(rows, dtype=torch.int64), self.history.device))
        return self._uploaded[1]

    def row(self, seq_id: int) -> int | None:
        """``seq_id``'s row, taken now if it has none; None when every row is taken."""
        row = self.rows.get(seq_id)
        if row is None and self.free:
            row = self.rows[seq_id] = self.free.pop()
        return row

    def load(self, row: int, tokens: list[int]) -> None:
        """Set a row to ``tokens`` (a sequence that starts drafting on the device: its tokens are all on the host)."""
        n = len(tokens)
        self.history[row, :n].copy_(upload(torch.tensor(tokens, dtype=torch.int64), self.history.device))
        self.lengths[row:row + 1].fill_(n)

    def release(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free.append(row)


def advance_ngram(samples: torch.Tensor, drafts: torch.Tensor, first_positions: torch.Tensor, rows: torch.Tensor,
                  history: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's outcome and the next step's inputs, for S sequences of K drafts each, on the device.

    ``samples`` [S, K + 1]: the target's tokens at each position; ``drafts`` [S, K]: the drafts verified;
    ``first_positions`` [S]: each chunk's first position; ``rows`` [S]: each sequence's row of ``history`` [R, H]
    (its first ``lengths`` [R] tokens verified, its last the chunk's first token). Accepted drafts: the leading ones
    equal to the sample before them (speculative.accepted). Appends each sequence's accepted drafts and bonus token to
    its history (``history`` and ``lengths`` updated in place), looks its next K drafts up there, and returns the next
    step's (input ids, positions) [S, K + 1]: the bonus token and the drafts, from the position after the bonus's."""
    num_seqs, k1 = samples.shape
    k = k1 - 1
    accepted = (drafts == samples[:, :k]).long().cumprod(1).sum(1)
    steps = torch.arange(k1, device=samples.device)
    length = lengths.index_select(0, rows)
    # every sample is written (the ones past the bonus are junk past the new length: overwritten later)
    at = (length[:, None] + steps).clamp_(max=history.shape[1] - 1)
    history.index_put_((rows[:, None].expand(-1, k1), at), samples)
    length = length + accepted + 1
    lengths.index_copy_(0, rows, length)
    bonus = samples.gather(1, accepted[:, None])
    next_drafts = lookup_drafts(history.index_select(0, rows), length, k, min_n, max_n)
    next_ids = torch.cat([bonus, next_drafts], 1)
    next_positions = (first_positions + accepted + 1)[:, None] + steps
    return next_ids, next_positions


def advance_ngram_host(samples: torch.Tensor, drafts: torch.Tensor, first_positions: torch.Tensor, rows: torch.Tensor,
                       history: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``advance_ngram`` for tensors in host memory (the CPU backend's, whose device is the host): a Python loop over
    the sequences with the host's own lookup (``lookup_ngram``'s substring search), ~20x cheaper there than the
    torch ops over every position of the history that a GPU runs in parallel. The same results."""
    k = samples.shape[1] - 1
    table = history.numpy()
    next_ids, next_positions = [], []
    for tokens, verified, first, row in zip(samples.tolist(), drafts.tolist(), first_positions.tolist(),
                                            rows.tolist()):
        num_accepted = accepted(verified, tokens)
        length = int(lengths[row])
        end = min(length + k + 1, table.shape[1])
        table[row, length:end] = tokens[:end - length]   # (all of them, as the device writes them)
        length += num_accepted + 1
        lengths[row] = length
        bonus = tokens[num_accepted]
        found = lookup_ngram(table[row, :length].tobytes(), k, min_n, max_n)
        next_ids.append([bonus, *pad_drafts(found, bonus, k)])
        next_positions.append(range(first + num_accepted + 1, first + num_accepted + 2 + k))
    return torch.tensor(next_ids), torch.tensor(next_positions)


def lookup_drafts(tokens: torch.Tensor, lengths: torch.Tensor, k: int, min_n: int, max_n: int) -> torch.Tensor:
    """``speculative.lookup_ngram`` for each row of ``tokens`` [S, H] (its first ``lengths`` [S] valid), padded as
    ``pad_drafts`` pads: [S, k]. The longest suffix of n in [min_n, max_n] tokens that occurs earlier, ending before
    the last token, at its latest occurrence; the k tokens after it."""
    num_seqs, width = tokens.shape
    device = tokens.device
    last = lengths - 1
    start = torch.full((num_seqs,), -1, dtype=torch.int64, device=device)
    where = torch.arange(width, device=device)
    for n in range(max_n, min_n - 1, -1):
        if n >= width:
            continue
        # match[s]: tokens[s + i] == the suffix's token i for every i < n (s in [0, width - n])
        span = width - n + 1
        match = torch.ones(num_seqs, span, dtype=torch.bool, device=device)
        for i in range(n):
            suffix_token = tokens.gather(1, (lengths - n + i).clamp(min=0)[:, None])
            match &= tokens[:, i:i + span] == suffix_token
        # an earlier occurrence ends before the last token: s + n <= last, and the sequence has n + 1 tokens
        match &= where[None, :span] + n <= last[:, None]
        match &= (lengths >= n + 1)[:, None]
        latest = torch.where(match, where[None, :span], -1).amax(1)
        found = (latest >= 0) & (start < 0)
        start = torch.where(found, latest + n, start)
    at = torch.where(start[:, None] >= 0, start[:, None] + torch.arange(k, device=device), last[:, None])
    return tokens.gather(1, torch.minimum(at, last[:, None]))


def lagged_fixup(ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, fill: torch.Tensor, next_ids: torch.Tensor,
                 next_positions: torch.Tensor, block_size: int) -> None:
    """Put a lagged step's inputs in place, on the device: every row's input id and position from the step before's
    ``advance_ngram`` (flat ``next_ids`` / ``next_positions``, row ``fill[1]`` for row ``fill[0]``), then its KV slot
    and each sequence's length from those positions. A lagged step's sequences each have the same number of rows."""
    ids.index_copy_(0, fill[0], next_ids.index_select(0, fill[1]))
    positions.index_copy_(0, fill[0], next_positions.index_select(0, fill[1]))
    num_seqs = seq_lens.shape[0]
    per_seq = positions.view(num_seqs, -1)
    seq_lens.copy_(per_seq[:, -1] + 1)
    blocks = block_tables.gather(1, per_seq.div(block_size, rounding_mode="floor").to(block_tables.dtype))
    slots.copy_((blocks.long() * block_size + per_seq % block_size).view(-1))
