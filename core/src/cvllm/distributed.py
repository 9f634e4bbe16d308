"""Tensor-parallel state: this process's rank, the world size and whether MoE experts are split whole over the
ranks (expert parallelism), read by the layers when they are built (their shard) and by the collectives
(engine/tensor_parallel/ sets them before building the model).

Collectives go through the backend of the forward pass (``Backend.all_reduce``/``all_gather``/``broadcast``:
``torch.distributed`` with NCCL or gloo); at world size 1 they are identity functions, so the layers stay honest
about where communication happens without paying for it.
"""

from __future__ import annotations

import torch

from cvllm.forward_context import get_forward_context

_tp_rank = 0
_tp_size = 1
_expert_parallel = False


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


def expert_parallel() -> bool:
    """MoE layers split their experts whole over the ranks (``enable_expert_parallel``) instead of sharding each
    expert; the other layers stay tensor-parallel either way."""
    return _expert_parallel


def set_tensor_parallel(rank: int, size: int, enable_expert_parallel: bool = False) -> None:
    """Set before a model is built: each parallel layer reads its shard from these once, in its constructor.
    Every call sets all three, so a later build in the same process (world size 1 again) starts from a clean state."""
    global _tp_rank, _tp_size, _expert_parallel
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} out of range for size {size}")
    _tp_rank, _tp_size, _expert_parallel = rank, size, enable_expert_parallel


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    return get_forward_context().backend.all_reduce(x)


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _tp_size == 1:
        return x
    return get_forward_context().backend.all_gather(x, dim=-1)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
