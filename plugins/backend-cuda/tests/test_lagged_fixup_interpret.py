"""The lagged-step fixup kernel (cvllm_cuda/kernels/lagged_fixup.py) against engine/ngram_device.py's torch ops: the
same ids, positions, slots and lengths, in Triton's CPU interpreter without a GPU, compiled where there is one."""

from __future__ import annotations

import os

import pytest
import torch

from cvllm.engine.ngram_device import lagged_fixup as reference
from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")  # a skip locally, an error under CI=true

from cvllm_cuda.kernels.lagged_fixup import lagged_fixup  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@pytest.mark.parametrize("num_seqs, rows_per_seq, block_size", [(1, 5, 16), (3, 5, 16), (8, 9, 4), (2, 2, 1),
                                                                 (40, 5, 16)])
def test_the_kernel_sets_what_the_torch_ops_set(num_seqs, rows_per_seq, block_size):
    generator = torch.Generator().manual_seed(num_seqs * 100 + rows_per_seq)
    num_rows, width = num_seqs * rows_per_seq, 12
    feed_seqs = num_seqs + 2   # the step before had more sequences, in another order
    next_ids = torch.randint(0, 1000, (feed_seqs * rows_per_seq,), generator=generator)
    starts = torch.randint(0, width * block_size - rows_per_seq, (feed_seqs,), generator=generator)
    next_positions = (starts[:, None] + torch.arange(rows_per_seq)).view(-1)
    order = torch.randperm(feed_seqs, generator=generator)[:num_seqs]
    fill = torch.stack([torch.arange(num_rows), (order[:, None] * rows_per_seq + torch.arange(rows_per_seq)).view(-1)])
    # the graphs' tables are wider than the step's (their own row stride): a view of a wider buffer
    tables = torch.randint(0, 500, (num_seqs, width + 3), generator=generator, dtype=torch.int32)[:, :width]
    host = {"ids": torch.zeros(num_rows, dtype=torch.int64), "positions": torch.arange(num_rows),
            "seq_lens": torch.full((num_seqs,), 7, dtype=torch.int32), "slots": torch.full((num_rows,), -5)}
    want = {name: t.clone() for name, t in host.items()}
    got = {name: t.clone().to(DEVICE) for name, t in host.items()}
    reference(want["ids"], want["positions"], want["seq_lens"], want["slots"], tables, fill, next_ids,
              next_positions, block_size)
    lagged_fixup(got["ids"], got["positions"], got["seq_lens"], got["slots"], tables.to(DEVICE), fill.to(DEVICE),
                 next_ids.to(DEVICE), next_positions.to(DEVICE), block_size)
    for name in host:
        assert torch.equal(got[name].cpu(), want[name]), name
