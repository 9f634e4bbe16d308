"""What rank 0 sends the workers: per step a header of a few int64 and one uint8 payload, over the host (gloo).

The payload is the step's packed host inputs (step_inputs.pack: the very bytes rank 0 uploads to its own device)
plus any prompt-logprob rows; each worker unpacks them and builds its device tensors and ForwardContext with the
same code as rank 0 (step_inputs.to_device): no pickling on the hot path, no second derivation of the context.
Input ids that only exist on rank 0's device (async scheduling: the in-flight step's sampled tokens) follow as a
broadcast on the device group (NCCL on CUDA), so rank 0 never waits for its device to send a step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cvllm.engine.step_inputs import HostStep, host_step_from_packed, to_device

# header fields: op, then an op's argument or a step's sizes
HEADER_LEN = 9
STEP, ALLOCATE_KV, SHUTDOWN, CAPTURE_GRAPHS, MEMORY = 1, 2, 3, 4, 5
DECODE_PATH, ALL_LOGITS, DECODE_ONLY, HIDDEN_ONLY = 1, 2, 4, 8   # flag bits


def new_header() -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64)


def send_op(op: int, *args: int) -> None:
    """A message without payload (allocate the KV cache, capture graphs, shut down)."""
    header = new_header()
    header[0] = op
    header[1:1 + len(args)] = torch.tensor(args, dtype=torch.int64)
    dist.broadcast(header, 0)


def op_args(header: torch.Tensor, count: int) -> list[int]:
    return header[1:1 + count].tolist()


def least_memory(backend) -> tuple[int, int]:
    """Every rank, after a MEMORY op: (free, total) device bytes of the rank with the least, on every rank."""
    memory = torch.tensor(backend.memory(), dtype=torch.int64)
    dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    return tuple(memory.tolist())


def process_group_backend(backend, device_comm: str | None = None) -> str:
    """The torch.distributed backend of the ranks' group: gloo on the CPU; on a device, gloo for the host
    messages and the backend's own (``Backend.dist_backend``, NCCL on CUDA) for its tensors. ``device_comm``
    replaces the latter (gloo: several ranks on one GPU, which NCCL refuses; tests)."""
    if backend.device.type == "cpu":
        return "gloo"
    return f"cpu:gloo,{backend.device.type}:{device_comm or backend.dist_backend}"


def eager_init_device(dist_backend: str, device: torch.device | None) -> torch.device | None:
    """``init_process_group``'s device_id: NCCL's communicator is set up at once, bound to this rank's device."""
    return device if "nccl" in dist_backend else None


def send_step(host: HostStep, packed: torch.Tensor, input_ids: torch.Tensor, extra_indices: torch.Tensor | None,
              decode_path: bool, all_logits: bool, hidden_only: bool = False) -> None:
    """Rank 0: the step to every worker. ``packed``: ``pack(host.tensors)``; ``input_ids``: rank 0's on its device,
    with the in-flight tokens filled in (sent only when the step has such rows)."""
    ids, _, _, seq_lens, _, tables, logits_indices, _ = host.tensors
    extra = None if extra_indices is None else extra_indices.to("cpu", torch.int64)
    payload = packed if extra is None else torch.cat([packed, extra.view(torch.uint8)])
    flags = (DECODE_PATH * decode_path | ALL_LOGITS * all_logits | DECODE_ONLY * host.is_decode_only
             | HIDDEN_ONLY * hidden_only)
    header = torch.tensor([STEP, payload.numel(), ids.numel(), seq_lens.numel(), tables.shape[1],
                           logits_indices.numel(), 0 if extra is None else extra.numel(), host.num_fill, flags],
                          dtype=torch.int64)
    dist.broadcast(header, 0)
    dist.broadcast(payload, 0)
    if host.num_fill:
        dist.broadcast(input_ids, 0)


def receive_step(header: torch.Tensor, backend, block_size: int):
    """A worker, after a STEP header: the rest of the step, as ``forward_prepared``'s arguments."""
    nbytes, num_tokens, num_seqs, max_blocks, num_logits, num_extra, num_fill, flags = header[1:].tolist()
    payload = torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(payload, 0)
    packed_bytes = nbytes - 8 * num_extra
    packed = payload[:packed_bytes]
    host = host_step_from_packed(packed, num_tokens, num_seqs, max_blocks, num_logits, num_fill,
                                 bool(flags & DECODE_ONLY))
    input_ids, positions, ctx, logits_indices = to_device(host, backend, block_size)
    if num_fill:
        dist.broadcast(input_ids, 0)   # rank 0's, with the in-flight tokens in place
    if num_extra:
        extra = payload[packed_bytes:].view(torch.int64)
        logits_indices = torch.cat([logits_indices, extra.to(logits_indices.device)])
    return (input_ids, positions, ctx, logits_indices, bool(flags & DECODE_PATH), bool(flags & ALL_LOGITS),
            bool(flags & HIDDEN_ONLY))

