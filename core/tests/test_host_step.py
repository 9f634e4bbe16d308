"""The host side of a step, built for speed, checked against plain references: the step inputs
(engine/step_inputs.py, written with NumPy straight into their packed buffer) against a per-token derivation, and the
n-gram lookup (engine/speculative.py, a substring search over the tokens' bytes) against a search over the list."""

from __future__ import annotations

import random

import pytest
import torch

from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.sequence import Sequence
from cvllm.engine.speculative import propose_ngram
from cvllm.engine.speculator import verified_bytes
from cvllm.engine.step_inputs import build_host_step, pack, to_device, unpack

BLOCK = 4


class _Cpu:
    device = torch.device("cpu")


def _batch(rng: random.Random, kinds: list[str]) -> tuple[ScheduledBatch, dict[int, int]]:
    """Sequences of each kind: a decode, a decode whose last token is in flight, a verify chunk (a token and
    drafts), a prefill chunk."""
    batch, previous_rows = ScheduledBatch(), {}
    for i, kind in enumerate(kinds):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(2, 40))]
        seq = Sequence(i, str(i), prompt, None)
        n = 1
        seq.num_computed_tokens = len(prompt) - 1
        if kind == "in flight":
            seq.num_computed_tokens, seq.num_inflight = len(prompt), 1
            previous_rows[i] = rng.randrange(4)
        elif kind == "verify":
            seq.num_drafts = rng.randrange(1, 5)
            seq.token_ids += [rng.randrange(1000) for _ in range(seq.num_drafts)]
            n += seq.num_drafts
        elif kind == "prefill":
            seq.num_computed_tokens = rng.randrange(len(prompt))
            n = rng.randrange(1, len(prompt) - seq.num_computed_tokens + 1)
        seq.block_table.extend(rng.sample(range(500), -(-(seq.num_computed_tokens + n) // BLOCK)))
        if seq.num_computed_tokens + n == seq.num_tokens:
            batch.sample_indices.append(i)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        if kind in ("verify", "prefill"):
            batch.num_prefill_tokens += n
        else:
            batch.num_decodes += 1
    return batch, previous_rows


@pytest.mark.parametrize("kinds", [["decode"], ["in flight"], ["verify"], ["prefill"],
                                   ["decode", "in flight", "verify", "prefill", "prefill", "verify", "in flight"]])
def test_step_inputs_equal_a_per_token_derivation(kinds):
    rng = random.Random(len(kinds))
    for _ in range(20):
        batch, previous_rows = _batch(rng, kinds)
        host = build_host_step(batch, BLOCK, previous_rows)
        ids, positions, slots, logits_rows, fill = [], [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            for position in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                if position < len(seq.token_ids):
                    ids.append(seq.token_ids[position])
                else:
                    fill.append((len(ids), previous_rows[seq.seq_id]))
                    ids.append(0)
                positions.append(position)
                slots.append(seq.block_table[position // BLOCK] * BLOCK + position % BLOCK)
            if i in batch.sample_indices:
                logits_rows += range(len(ids) - 1 - seq.num_drafts, len(ids))
        tables = torch.zeros(len(batch.seqs), max(len(seq.block_table) for seq in batch.seqs), dtype=torch.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table.tolist())
        lens = [seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_tokens)]
        starts = [0]
        for n in batch.num_tokens:
            starts.append(starts[-1] + n)
        expected = [torch.tensor(ids), torch.tensor(positions), torch.tensor(starts, dtype=torch.int32),
                    torch.tensor(lens, dtype=torch.int32), torch.tensor(slots), tables,
                    torch.tensor(logits_rows, dtype=torch.long), torch.tensor(fill, dtype=torch.long).view(-1, 2).T]
        for got, want in zip(host.tensors, expected):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert (host.query_start, host.seq_lens, host.num_fill) == (starts, lens, len(fill))
        # the tensors are the packed buffer's bytes, laid out as pack lays them out
        assert torch.equal(host.packed, pack(host.tensors))
        shapes = [(tuple(t.shape), t.dtype) for t in host.tensors]
        assert all(torch.equal(a, b) for a, b in zip(unpack(host.packed, shapes), host.tensors))
        # the in-flight rows take the previous step's sampled ids
        previous_ids = torch.arange(100, 104)
        got_ids = to_device(host, _Cpu(), BLOCK, previous_ids)[0]
        for row, source in fill:
            assert got_ids[row] == 100 + source


def _reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed the latest earlier occurrence of the longest suffix of n in [min_n, max_n] tokens."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):   # the occurrence tokens[end - n:end], ending before the last
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_ngram_lookup_equals_a_search_over_the_list():
    rng = random.Random(0)
    # among them tokens whose int64 bytes match across token boundaries (a byte search must not take those)
    alphabets = [[0, 1], list(range(5)), list(range(300)), [0x0101010101010101, 0x0100000000000001, 1, 256, 1 << 56]]
    found = 0
    for _ in range(5000):
        alphabet = rng.choice(alphabets)
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n, k = rng.randrange(min_n, 6), rng.randrange(1, 6)
        drafts = propose_ngram(tokens, k, min_n, max_n)
        assert drafts == _reference_ngram(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        found += bool(drafts)
    assert found > 1000


def test_a_sequences_lookup_bytes_follow_its_verified_tokens():
    seq = Sequence(0, "0", [5, 6, 7], None)
    assert bytes(verified_bytes(seq)) == bytes(torch.tensor([5, 6, 7]).numpy().data)
    seq.token_ids += [8, 9]
    data = verified_bytes(seq)
    assert data is seq.ngram_bytes and len(data) == 5 * 8 and bytes(data[24:]) == bytes(torch.tensor([8, 9]).numpy())
