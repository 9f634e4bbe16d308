"""engine/ngram_device.py against the host's rules: the device's n-gram lookup gives speculative.lookup_ngram's
drafts (padded as pad_drafts pads), advance_ngram a verify step's accepted count, history and next inputs as the
host would derive them, and lagged_fixup the positions, slots and lengths build_host_step would have built."""

from __future__ import annotations

import random

import torch

from cvllm.engine.ngram_device import (
    NgramHistory,
    advance_ngram,
    advance_ngram_host,
    lagged_fixup,
    lookup_drafts,
    pad_drafts,
)
from cvllm.engine.speculative import accepted, propose_ngram


def test_lookup_gives_the_hosts_drafts_padded():
    rng = random.Random(0)
    for _ in range(2000):
        num_seqs, width, k = rng.randint(1, 4), rng.randint(2, 40), rng.randint(1, 6)
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        vocab = rng.randint(2, 6)   # small: matches of every length are common
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(1, width))] for _ in range(num_seqs)]
        tokens = torch.randint(0, vocab, (num_seqs, width))   # junk past each length
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = torch.tensor(seq)
        got = lookup_drafts(tokens, torch.tensor([len(s) for s in seqs]), k, min_n, max_n).tolist()
        assert got == [pad_drafts(propose_ngram(s, k, min_n, max_n), s[-1], k) for s in seqs], (seqs, k, min_n, max_n)


def test_advance_is_the_hosts_verify_outcome_and_next_step():
    rng = random.Random(1)
    for _ in range(300):
        num_seqs, k, vocab = rng.randint(1, 4), rng.randint(1, 5), 3
        history = NgramHistory(6, 64, torch.device("cpu"))
        seqs = [[rng.randrange(vocab) for _ in range(rng.randint(2, 30))] for _ in range(num_seqs)]
        seq_ids = rng.sample(range(100), num_seqs)
        for seq_id, seq in zip(seq_ids, seqs):
            history.load(history.row(seq_id), seq)
        untouched = history.history.clone()
        samples, drafts = torch.randint(0, vocab, (num_seqs, k + 1)), torch.randint(0, vocab, (num_seqs, k))
        first = torch.tensor([len(s) - 1 for s in seqs])   # each chunk starts at its sequence's last token
        rows = history.rows_tensor(seq_ids)
        next_ids, next_positions = advance_ngram(samples, drafts, first, rows, history.history, history.lengths, 1, 3)
        for i, seq in enumerate(seqs):
            a = accepted(drafts[i].tolist(), samples[i].tolist())
            new = seq + samples[i, :a + 1].tolist()
            row = int(rows[i])
            assert int(history.lengths[row]) == len(new) and history.history[row, :len(new)].tolist() == new
            assert next_ids[i].tolist() == [new[-1]] + pad_drafts(propose_ngram(new, k, 1, 3), new[-1], k)
            assert next_positions[i].tolist() == list(range(len(new) - 1, len(new) + k))
        others = [r for r in range(6) if r not in rows.tolist()]
        assert torch.equal(history.history[others], untouched[others])


def test_lagged_fixup_sets_positions_slots_and_lengths():
    block_size = 4
    tables = torch.tensor([[3, 7, 1], [5, 0, 2]], dtype=torch.int32)
    next_ids = torch.tensor([[11, 12, 13], [21, 22, 23]]).view(-1)
    next_positions = torch.tensor([[6, 7, 8], [2, 3, 4]]).view(-1)
    # the step lists the second sequence first; its host-built values are a step behind (placeholders)
    ids, positions = torch.zeros(6, dtype=torch.int64), torch.tensor([0, 1, 2, 5, 6, 7])
    seq_lens, slots = torch.tensor([3, 8], dtype=torch.int32), torch.zeros(6, dtype=torch.int64)
    fill = torch.tensor([[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2]])
    lagged_fixup(ids, positions, seq_lens, slots, tables[[1, 0]], fill, next_ids, next_positions, block_size)
    assert ids.tolist() == [21, 22, 23, 11, 12, 13] and positions.tolist() == [2, 3, 4, 6, 7, 8]
    assert seq_lens.tolist() == [5, 9]
    assert slots.tolist() == [5 * 4 + 2, 5 * 4 + 3, 0 * 4 + 0, 7 * 4 + 2, 7 * 4 + 3, 1 * 4 + 0]


def test_the_hosts_advance_is_the_devices():
    """advance_ngram_host (the CPU backend's) against the torch ops a GPU runs: the same next inputs and history."""
    rng = random.Random(2)
    for _ in range(300):
        num_seqs, k, vocab, width = rng.randint(1, 4), rng.randint(1, 6), rng.randint(2, 5), 48
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        tables = [NgramHistory(5, width, torch.device("cpu")) for _ in range(2)]
        seq_ids = rng.sample(range(50), num_seqs)
        for seq_id in seq_ids:
            seq = [rng.randrange(vocab) for _ in range(rng.randint(2, width - k - 2))]
            for table in tables:
                table.load(table.row(seq_id), seq)
        samples, drafts = torch.randint(0, vocab, (num_seqs, k + 1)), torch.randint(0, vocab, (num_seqs, k))
        samples[:, :k] = torch.where(torch.rand(num_seqs, k) < 0.6, drafts, samples[:, :k])   # many accepted
        first = torch.randint(0, 100, (num_seqs,))
        outs = [fn(samples, drafts, first, table.rows_tensor(seq_ids), table.history, table.lengths, min_n, max_n)
                for fn, table in zip((advance_ngram, advance_ngram_host), tables)]
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        assert torch.equal(tables[0].lengths, tables[1].lengths)
        for row, length in enumerate(tables[0].lengths.tolist()):
            assert torch.equal(tables[0].history[row, :length], tables[1].history[row, :length])
