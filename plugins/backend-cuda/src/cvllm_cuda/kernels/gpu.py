"""What the kernel wrappers ask of the GPU they launch on, asked once per device: its name (the key of the
committed tuned tables), its SM count, its compute capability, and a tuned table's entry for it."""

from __future__ import annotations

import functools
from typing import Any

import torch


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tuned_entry(table: dict[str, dict[Any, Any]], device: torch.device, key: Any) -> Any:
    """``table[name of device's GPU][key]``, or None (not a CUDA device, a GPU nobody tuned, a key not swept)."""
    if device.type != "cuda":
        return None
    return table.get(device_name(device_index(device)), {}).get(key)
