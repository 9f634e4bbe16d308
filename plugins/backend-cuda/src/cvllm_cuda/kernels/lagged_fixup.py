"""A lagged verify step's inputs put in place in one launch (engine/ngram_device.py's ``lagged_fixup``).

The host built the step a step behind; the device knows its input ids and positions (the step before's
``advance_ngram``). Each row copies its id and position from there and derives its KV slot from its sequence's
block table; each sequence's last row sets its length. As torch ops that is ~13 launches on the host's critical
path of every lagged step (~5 us each on the H200's host); here one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lagged_fixup_kernel(ids_ptr, positions_ptr, seq_lens_ptr, slots_ptr, tables_ptr, table_stride, fill_ptr,
                         fill_stride, next_ids_ptr, next_positions_ptr, num_rows, rows_per_seq,
                         BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offsets < num_rows
    row = tl.load(fill_ptr + offsets, mask=valid, other=0)                 # fill[0]: the row here
    source = tl.load(fill_ptr + fill_stride + offsets, mask=valid, other=0)   # fill[1]: its row in the feed
    token = tl.load(next_ids_ptr + source, mask=valid, other=0)
    position = tl.load(next_positions_ptr + source, mask=valid, other=0)
    seq = row // rows_per_seq   # (a lagged step: every sequence has rows_per_seq rows, in order)
    block = tl.load(tables_ptr + seq * table_stride + position // BLOCK_SIZE, mask=valid, other=0)
    tl.store(ids_ptr + row, token, mask=valid)
    tl.store(positions_ptr + row, position, mask=valid)
    tl.store(slots_ptr + row, block.to(tl.int64) * BLOCK_SIZE + position % BLOCK_SIZE, mask=valid)
    last = valid & (row % rows_per_seq == rows_per_seq - 1)
    tl.store(seq_lens_ptr + seq, (position + 1).to(tl.int32), mask=last)


def lagged_fixup(ids: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor, slots: torch.Tensor,
                 block_tables: torch.Tensor, fill: torch.Tensor, next_ids: torch.Tensor,
                 next_positions: torch.Tensor, block_size: int) -> None:
    """ngram_device.lagged_fixup's contract (int64 ids, positions, slots and fill; int32 lengths and tables)."""
    num_rows = fill.shape[1]
    if num_rows == 0:
        return
    block = 128
    _lagged_fixup_kernel[(triton.cdiv(num_rows, block),)](
        ids, positions, seq_lens, slots, block_tables, block_tables.stride(0), fill, fill.stride(0), next_ids,
        next_positions, num_rows, num_rows // seq_lens.shape[0], BLOCK_SIZE=block_size, BLOCK=block)
