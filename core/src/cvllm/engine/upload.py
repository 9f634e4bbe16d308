"""Host-to-device copies that never wait for the device.

A copy from pageable memory waits for all work queued on the stream first, i.e. for the step still running
on the GPU, and async scheduling would overlap nothing. So every per-step input goes up from pinned memory
without blocking (torch's caching host allocator keeps the pinned block until the copy has run)."""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a CPU tensor) on ``device``; itself on the CPU. On the meta device only its shape: nothing is copied
    (bench/prepare_cpu.py times building a device step's inputs without a device)."""
    if device.type in ("cpu", "meta"):
        return t if device.type == "cpu" else t.to(device)
    if device.type == "mps":   # unified memory: no pinned staging (pin_memory has failed on MPS in torch releases)
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
