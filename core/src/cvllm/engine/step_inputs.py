"""A step's inputs: built on the host from a scheduled batch, packed into one byte buffer, put on the device.

Two halves, because tensor parallelism needs the middle: rank 0 builds the host step (``build_host_step``) and
sends its packed bytes to the other ranks (tensor_parallel/messages.py), and every rank turns the same bytes into
its device tensors and ForwardContext (``to_device``), so no rank derives a context its own way.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from cvllm.engine.scheduler import ScheduledBatch
from cvllm.engine.upload import upload
from cvllm.forward_context import ForwardContext

# bytes between the starts of the step inputs in their one buffer: Triton compiles a kernel variant per pointer
# alignment (16 or not), so views whose alignment followed the step's token count would compile new variants
# mid-serving (~0.5 s each)
ALIGN = 16


class PreviousTokens(NamedTuple):
    """The step still in flight, as the next step's inputs read it on the device: its sampled token ids and each
    sampling sequence's row in them; or, after a verify step whose next inputs the device computed (ngram_device.py),
    those ids, each sequence's first row in them, and their ``positions`` (the next step is then lagged)."""
    ids: torch.Tensor
    rows: dict[int, int]
    positions: torch.Tensor | None = None

NUMPY_DTYPES = {torch.int64: np.dtype(np.int64), torch.int32: np.dtype(np.int32)}


@dataclass(slots=True)
class HostStep:
    """The host tensors of a step and what the ForwardContext keeps as host lists. ``tensors``, in this order (the
    order of ``layout``): input ids, positions, query starts, sequence lengths, slots, block tables, logits rows,
    fill ([2, F]: rows here, rows in the in-flight step's sampled ids). ``packed``: the buffer they are views of,
    laid out as ``pack`` lays them out (what a device upload and a tensor-parallel broadcast send); None: not
    packed yet."""
    tensors: list[torch.Tensor]
    query_start: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    is_decode_only: bool
    packed: torch.Tensor | None = None

    @property
    def num_fill(self) -> int:
        """Rows whose input id is the in-flight step's sampled token, known on the device only (async scheduling)."""
        return self.tensors[7].shape[1]


def build_host_step(batch: ScheduledBatch, block_size: int, previous_rows: dict[int, int] | None) -> HostStep:
    """Flat varlen tensors for the batch, written straight into their packed buffer. Python touches each
    sequence, never each token; the per-token arithmetic is NumPy's (a call costs a tenth of a torch op's on
    tensors this small: at batch 1 the fixed cost per op is the whole cost).

    ``previous_rows``: seq_id -> row in the sampled ids of the step still in flight; a sequence whose last token
    is among them gets a placeholder id and a ``fill`` entry (row here, row there). A lagged sequence (every token
    of its chunk on the device: speculator.py's ``lag``) gets one for each, from its row there on."""
    bs = block_size
    seqs, qlens = batch.seqs, batch.num_tokens
    starts = [seq.num_computed_tokens for seq in seqs]
    input_ids: list[int] = []
    fill_at: list[int] = []       # rows of input_ids whose token is on the device only
    fill_from: list[int] = []     # ... and where it is in the previous step's sampled ids
    for seq, s, n in zip(seqs, starts, qlens):
        known = seq.token_ids[s:s + n]
        input_ids.extend(known)
        if len(known) < n:        # the last token is still in flight (a decode row), or the whole chunk (lagged)
            first, missing = previous_rows[seq.seq_id], n - len(known)
            fill_at.extend(range(len(input_ids), len(input_ids) + missing))
            fill_from.extend(range(first, first + missing))
            input_ids.extend([0] * missing)
    seq_lens = [s + n for s, n in zip(starts, qlens)]
    query_start = [0, *itertools.accumulate(qlens)]
    # a sampled sequence's last row; a speculating one's last 1 + K (every draft position is sampled: speculative.py)
    logits_rows = [row for i in batch.sample_indices
                   for row in range(query_start[i + 1] - 1 - seqs[i].num_drafts, query_start[i + 1])]
    max_blocks = max(len(seq.block_table) for seq in seqs)
    # the block tables as one flat int32 buffer, padded per row: each row is a memcpy of the sequence's int32
    # block table (18x cheaper than converting a list's ints at 256 sequences)
    tables = array.array("i")
    padding = array.array("i", [0]) * max_blocks
    for seq in seqs:
        tables.extend(seq.block_table)
        tables.extend(padding[len(seq.block_table):])

    num_seqs, num_tokens = len(seqs), len(input_ids)
    shapes, offsets, size = placed_layout(num_tokens, num_seqs, max_blocks, len(logits_rows), len(fill_at))
    packed = np.zeros(size, dtype=np.uint8)
    views = [np.ndarray(shape, NUMPY_DTYPES[dtype], packed, at) for (shape, dtype), at in zip(shapes, offsets)]
    ids, positions, query_start_v, seq_lens_v, slots, block_tables, logits_indices, fill = views
    ids[:] = input_ids
    query_start_v[:] = query_start
    seq_lens_v[:] = seq_lens
    block_tables.reshape(-1)[:] = np.frombuffer(tables, dtype=np.int32)
    logits_indices[:] = logits_rows
    fill[0], fill[1] = fill_at, fill_from
    if num_tokens == num_seqs and min(qlens) == 1:   # a token each (decodes): the positions are the starts
        positions[:] = starts
        seq_index = np.arange(num_seqs)
    else:                         # each chunk's positions run on from its start
        seq_index = np.repeat(np.arange(num_seqs), qlens)
        np.subtract(np.arange(num_tokens), np.repeat(np.subtract(query_start[:-1], starts), qlens), out=positions)
    np.multiply(block_tables[seq_index, positions // bs], bs, out=slots, dtype=np.int64)
    slots += positions % bs
    return HostStep([torch.from_numpy(v) for v in views], query_start, list(qlens), seq_lens,
                    batch.num_prefill_tokens == 0, torch.from_numpy(packed))


def placement(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[int], int]:
    """Where ``pack`` puts tensors of these shapes: each one's byte offset (a multiple of ``ALIGN``), and the
    buffer's size."""
    offsets, end = [], 0
    for shape, dtype in shapes:
        offsets.append(end)
        size = math.prod(shape) * dtype.itemsize
        end += size + (-size % ALIGN)
    return offsets, end


@functools.lru_cache(maxsize=1024)
def placed_layout(num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int, num_fill: int
                  ) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], list[int], int]:
    """``layout`` and its ``placement`` (offsets, size), kept for the sizes steps repeat (a fifth of a batch-1 step's
    host packing time otherwise). Not to be modified."""
    shapes = layout(num_tokens, num_seqs, max_blocks, num_logits, num_fill)
    return (shapes, *placement(shapes))


def layout(num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int, num_fill: int
           ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each of a step's tensors, from its sizes (what a receiving rank knows)."""
    i64, i32 = torch.int64, torch.int32
    return [((num_tokens,), i64), ((num_tokens,), i64), ((num_seqs + 1,), i32), ((num_seqs,), i32),
            ((num_tokens,), i64), ((num_seqs, max_blocks), i32), ((num_logits,), i64), ((2, num_fill), i64)]


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors' bytes in one uint8 buffer, each starting at a multiple of ``ALIGN``."""
    parts = []
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        pad = -raw.numel() % ALIGN
        parts += [raw, torch.zeros(pad, dtype=torch.uint8)] if pad else [raw]
    return torch.cat(parts)


def unpack(packed: torch.Tensor, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """``pack``'s inverse: views into ``packed`` (on whatever device it is), no copies. Each is one ``as_strided`` of
    the buffer viewed in its dtype: a slice and two views per tensor cost twice the host time, every step."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    out = []
    for (shape, dtype), offset in zip(shapes, placement(shapes)[0]):
        base = typed.get(dtype)
        if base is None:
            base = typed[dtype] = packed.view(dtype)
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
        out.append(base.as_strided(shape, strides, base.storage_offset() + offset // dtype.itemsize))
    return out


def host_step_from_packed(packed: torch.Tensor, num_tokens: int, num_seqs: int, max_blocks: int, num_logits: int,
                          num_fill: int, is_decode_only: bool) -> HostStep:
    """A receiving rank's HostStep from the packed bytes rank 0 sent."""
    tensors = unpack(packed, layout(num_tokens, num_seqs, max_blocks, num_logits, num_fill))
    query_start = tensors[2].tolist()
    seq_lens = tensors[3].tolist()
    query_lens = [b - a for a, b in zip(query_start, query_start[1:])]
    return HostStep(tensors, query_start, query_lens, seq_lens, is_decode_only, packed)


def to_device(host: HostStep, backend, block_size: int, previous_ids: torch.Tensor | None = None, staging=None,
              previous_positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, ForwardContext, torch.Tensor]:
    """(input ids, positions, context, logits rows) on the backend's device, in one non-blocking upload (a decode
    step has eight inputs, and each copy has a fixed cost) of ``host.packed`` (packed here if the host step has
    none). They travel as bytes and are viewed back in their own dtypes: no conversion kernel on the device.
    ``previous_ids``: the in-flight step's sampled ids on the device, for the ``fill`` rows (None: leave them, a
    tensor-parallel worker gets them from rank 0). ``staging``: where the backend's graphs read their inputs
    (``stage(host)``: the tensors there, or None for a step that does not fit): a step that fits goes there.
    ``previous_positions``: a lagged step's positions, computed on the device with ``previous_ids`` (ngram_device.py):
    its positions, slots and sequence lengths are set from them there; the host's were one step behind."""
    device = backend.device
    staged = staging.stage(host) if staging is not None else None
    if staged is not None:
        ids, positions, query_start, seq_lens, slots, tables, logits_indices, fill = staged
    elif device.type == "cpu":
        ids, positions, query_start, seq_lens, slots, tables, logits_indices, fill = host.tensors
    else:
        packed = pack(host.tensors) if host.packed is None else host.packed
        shapes = [(tuple(t.shape), t.dtype) for t in host.tensors]
        ids, positions, query_start, seq_lens, slots, tables, logits_indices, fill = unpack(
            upload(packed, device), shapes)
    seq_lens_host = host.seq_lens
    if previous_positions is not None:
        backend.lagged_fixup(ids, positions, seq_lens, slots, tables, fill, previous_ids, previous_positions,
                             block_size)
        if device.type == "cpu":   # (the CPU's attention reads the lengths as host lists: here they are at hand)
            seq_lens_host = seq_lens.tolist()
    elif previous_ids is not None and host.num_fill:   # sampled ids feed the next step's input ids on the device
        ids.index_copy_(0, fill[0], previous_ids.index_select(0, fill[1]))   # (cheaper to call than ids[...] = ...)
    ctx = ForwardContext(
        backend=backend,
        query_start_loc=query_start,
        seq_lens=seq_lens,
        slot_mapping=slots,
        block_tables=tables,
        query_start_loc_cpu=host.query_start,
        query_lens_cpu=host.query_lens,
        seq_lens_cpu=seq_lens_host,
        max_query_len=max(host.query_lens),
        max_seq_len=max(seq_lens_host),
        is_decode_only=host.is_decode_only,
        block_size=block_size,
    )
    return ids, positions, ctx, logits_indices
