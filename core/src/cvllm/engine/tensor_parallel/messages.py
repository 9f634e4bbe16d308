"""What rank 0 sends the workers: per step one header (a few int64) and one uint8 payload, both broadcast.

The payload is the step's prepared inputs as raw bytes (input ids, positions, slots, logits rows, query starts,
sequence lengths, block tables), viewed back in their dtypes on arrival: no pickling on the hot path, and the
workers rebuild the ForwardContext without seeing a Sequence. The int64 tensors come first, so every view starts
at a multiple of its element size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cvllm.forward_context import ForwardContext

HEADER_LEN = 8
STEP, ALLOCATE_KV, SHUTDOWN = 1, 2, 3
DECODE_PATH, ALL_LOGITS, DECODE_ONLY = 1, 2, 4   # flag bits


def joined_key(rank: int) -> str:
    """The store key a worker sets once connected to rank 0's store, before it joins the process group."""
    return f"cvllm/tp/joined/{rank}"


def new_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def send_op(op: int, arg: int = 0) -> None:
    """A message without payload (allocate the KV cache, shut down)."""
    header = new_header()
    header[0], header[7] = op, arg
    dist.broadcast(header, 0)


def send_step(input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor,
              decode_path: bool, all_logits: bool) -> None:
    """Rank 0: the step's inputs to every worker, in two broadcasts (header, payload)."""
    longs = [input_ids, positions, ctx.slot_mapping, logits_indices]
    ints = [ctx.query_start_loc, ctx.seq_lens, ctx.block_tables]
    payload = torch.cat([t.to("cpu", torch.int64).reshape(-1).view(torch.uint8) for t in longs]
                        + [t.to("cpu", torch.int32).reshape(-1).view(torch.uint8) for t in ints])
    flags = DECODE_PATH * decode_path | ALL_LOGITS * all_logits | DECODE_ONLY * ctx.is_decode_only
    header = torch.tensor([STEP, payload.numel(), input_ids.numel(), ctx.seq_lens.numel(),
                           ctx.block_tables.shape[1], logits_indices.numel(), flags, 0], dtype=torch.int64)
    dist.broadcast(header, 0)
    dist.broadcast(payload, 0)


def receive_step(header: torch.Tensor, backend, block_size: int, device: torch.device):
    """A worker, after a STEP header: the payload, as ``forward_prepared``'s arguments."""
    nbytes, num_tokens, num_seqs, max_blocks, num_logits, flags = header[1:7].tolist()
    payload = torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(payload, 0)
    sizes = [(num_tokens, torch.int64), (num_tokens, torch.int64), (num_tokens, torch.int64),
             (num_logits, torch.int64), (num_seqs + 1, torch.int32), (num_seqs, torch.int32),
             (num_seqs * max_blocks, torch.int32)]
    parts, offset = [], 0
    for count, dtype in sizes:
        size = count * dtype.itemsize
        parts.append(payload[offset:offset + size].view(dtype).to(device))
        offset += size
    input_ids, positions, slots, logits_indices, query_start, seq_lens, tables = parts
    query_start_cpu, seq_lens_cpu = parts[4].tolist(), parts[5].tolist()
    query_lens = [b - a for a, b in zip(query_start_cpu, query_start_cpu[1:])]
    ctx = ForwardContext(
        backend=backend, query_start_loc=query_start, seq_lens=seq_lens, slot_mapping=slots,
        block_tables=tables.view(num_seqs, max_blocks), query_start_loc_cpu=query_start_cpu,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens_cpu, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens_cpu), is_decode_only=bool(flags & DECODE_ONLY), block_size=block_size)
    return input_ids, positions, ctx, logits_indices, bool(flags & DECODE_PATH), bool(flags & ALL_LOGITS)
