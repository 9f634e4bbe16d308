"""Tensor-parallel state. World size 1 for now; the layers are already split as if it weren't.

Collectives go through the backend of the forward pass (``Backend.all_reduce``/``all_gather``/``broadcast``:
``torch.distributed`` with NCCL or gloo); at world size 1 they are identity functions, so the layers stay honest
about where communication happens without paying for it.
"""

from __future__ import annotations

import torch

from cvllm.forward_context import get_forward_context

_tp_rank = 0
_tp_size = 1


def tp_rank() -> int:
    return _tp_rank


def tp_size() -> int:
    return _tp_size


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
