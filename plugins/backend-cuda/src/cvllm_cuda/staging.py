"""A step's inputs put on the device where the CUDA graphs read them: one copy from pinned memory, no device copies.

The general upload (engine/step_inputs.py) sends a step's packed bytes to a fresh device buffer and views them there;
a graph replay then copied five of those tensors into its own buffers and filled the padding rows: seven launches,
plus a pinned allocation and eight views a step, all on the host between two device steps. That is the critical path
of a synchronous step (a speculative verify step waits for its outcome before the next is built), where on a small
model the device waits for it. Here every input has a fixed place in one device region, which the graphs' input
buffers are views of (graphs.py), and a step is written into a pinned twin of that region on the host, padding
included (the rows past the step's write no KV: slot -1; the padding sequences of a graph attend to Q keys), and
copied up in one transfer. The block tables are written in the graphs' own [sequences, max blocks] layout (the
kernels take a row stride), the region's last part, so a step's transfer ends with its last sequence's row: up to
TABLE_BYTES of them, past which (many sequences of a long context) a step takes the general upload.

Twins are used in turn, each reused only once its last copy has run (an event): the host builds step t + 1 while step
t's copy may still be queued behind step t - 1 (async scheduling). The device region itself needs no such care: the
copy into it is queued after every kernel that read the last step's inputs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cvllm.engine.step_inputs import HostStep, placed_layout, placement

TWINS = 3
# bytes of block-table rows a staged step may have (each row max_blocks_per_seq entries): 64 sequences of 4,096
# blocks (64k tokens of context); a step with more takes the general upload
TABLE_BYTES = 1 << 20


class StepStaging:
    def __init__(self, device: torch.device, rows: int, seqs: int, max_blocks: int, table_bytes: int = TABLE_BYTES):
        """Room for steps of up to ``rows`` tokens (and logits rows), ``seqs`` sequences (those of them that fit
        ``table_bytes``, in a twin) and ``max_blocks`` blocks a sequence."""
        self.rows, self.seqs, self.max_blocks = rows, seqs, max_blocks
        self.table_rows = min(seqs, max(1, table_bytes // (4 * max_blocks)))   # rows a twin holds
        i64, i32 = torch.int64, torch.int32
        # step_inputs.layout's tensors (ids, positions, query starts, sequence lengths, slots, block tables, logits
        # rows, fill), placed with the block tables last: a step's transfer ends where its tables do
        # (fill: a row each at most, every row of a lagged step's chunks: engine/ngram_device.py)
        regions = [((rows,), i64), ((rows,), i64), ((seqs + 1,), i32), ((seqs,), i32), ((rows,), i64),
                   ((rows,), i64), ((2 * rows,), i64), ((seqs, max_blocks), i32)]
        placed, size = placement(regions)
        self.offsets = [*placed[:5], placed[7], placed[5], placed[6]]   # in the layout's order
        self.tables_at = placed[7]
        self.region = torch.zeros(size, dtype=torch.uint8, device=device)
        self.twins: list[torch.Tensor] = []   # made at the first step staged (none while nothing is)
        self._copied: list[torch.cuda.Event | None] = [None] * TWINS
        self._next = 0
        self._typed = {dtype: self.region.view(dtype) for dtype in (i64, i32)}
        self._views: dict[tuple, list[torch.Tensor]] = {}
        # what the graphs' buffers are views of (their whole regions)
        whole = [self._view(shape, dtype, offset) for (shape, dtype), offset in zip(regions, placed)]
        self.input_ids, self.positions, self.query_start, self.seq_lens, self.slot_mapping = whole[:5]
        self.block_tables = whole[7]
        self.device = device

    def _make_twins(self) -> None:
        size = self.tables_at + self.table_rows * self.max_blocks * 4
        pinned = self.device.type == "cuda"
        self.twins = [torch.zeros(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(TWINS)]
        self._twin_bytes = [twin.numpy() for twin in self.twins]
        self._twin_tables = [b[self.tables_at:].view(np.int32).reshape(self.table_rows, self.max_blocks)
                             for b in self._twin_bytes]

    def _view(self, shape: tuple[int, ...], dtype: torch.dtype, offset: int, row_stride: int = 0) -> torch.Tensor:
        base = self._typed[dtype]
        strides = (row_stride or shape[1], 1) if len(shape) == 2 else (1,)
        return base.as_strided(shape, strides, base.storage_offset() + offset // dtype.itemsize)

    def fits(self, num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int, num_fill: int = 0) -> bool:
        return (num_tokens <= self.rows and num_seqs <= self.table_rows and max_blocks <= self.max_blocks
                and num_logits <= self.rows and num_fill <= self.rows)

    def stage(self, host: HostStep) -> list[torch.Tensor] | None:
        """``host``'s eight tensors (step_inputs.layout's order) on the device, in this region; None where the step
        does not fit (the caller uploads it the general way)."""
        shapes = [(tuple(t.shape), t.dtype) for t in host.tensors]
        num_tokens, num_seqs = shapes[0][0][0], shapes[3][0][0]
        max_blocks, num_logits, num_fill = shapes[5][0][1], shapes[6][0][0], shapes[7][0][1]
        if not self.fits(num_tokens, num_seqs, max_blocks, num_logits, num_fill):
            return None
        if not self.twins:
            self._make_twins()
        i = self._next
        self._next = (i + 1) % TWINS
        if self._copied[i] is not None:
            self._copied[i].synchronize()   # (its copy ran long ago: a step or two back)
        twin = self._twin_bytes[i]
        packed = host.packed.numpy()
        sources = placed_layout(num_tokens, num_seqs, max_blocks, num_logits, num_fill)[1]   # (its bytes in packed)
        for j, ((shape, dtype), source, target) in enumerate(zip(shapes, sources, self.offsets)):
            nbytes = math.prod(shape) * dtype.itemsize
            if j == 5:   # the block tables, into rows of max_blocks entries (past a sequence's blocks: stale)
                tables = packed[source:source + nbytes].view(np.int32).reshape(num_seqs, max_blocks)
                self._twin_tables[i][:num_seqs, :max_blocks] = tables
            else:
                twin[target:target + nbytes] = packed[source:source + nbytes]
        # the rows past the step write no KV (a graph's padding rows, a chunk graph's spare rows), and a graph's
        # padding sequences attend to Q keys, Q the step's queries a sequence
        slots_at, seq_lens_at = self.offsets[4], self.offsets[3]
        twin[slots_at + num_tokens * 8:slots_at + self.rows * 8].view(np.int64)[:] = -1
        twin[seq_lens_at + num_seqs * 4:seq_lens_at + self.seqs * 4].view(np.int32)[:] = max(host.query_lens)
        end = self.tables_at + num_seqs * self.max_blocks * 4
        self.region[:end].copy_(self.twins[i][:end], non_blocking=True)
        if self.device.type == "cuda":
            event = self._copied[i] or torch.cuda.Event()
            event.record()
            self._copied[i] = event
        key = (num_tokens, num_seqs, max_blocks, num_logits, num_fill)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 512:   # (keys follow the steps' sizes: bounded, but not small)
                self._views.clear()
            views = self._views[key] = [self._view(shape, dtype, offset, self.max_blocks if j == 5 else 0)
                                        for j, ((shape, dtype), offset) in enumerate(zip(shapes, self.offsets))]
        return views

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is this region's input ids (a staged step: the graphs need not copy its inputs)."""
        return t.data_ptr() == self.input_ids.data_ptr()
