"""Where the metal backend runs and how much memory it may take: the MPS device, or the CPU under the test flag.

Nothing here initialises Metal at import: the engine imports the backend class on every machine while it chooses one.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable

import torch

from cvllm.backends.cpu import CpuBackend

logger = logging.getLogger(__name__)

# CVLLM_METAL_ON_CPU=1: the metal backend, unchanged, on CPU tensors (how CI tests it without a Mac); it is then
# "available" and, by its priority, chosen over the CPU backend when no --backend is named
ON_CPU_ENV = "CVLLM_METAL_ON_CPU"


def on_cpu_requested() -> bool:
    return os.environ.get(ON_CPU_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def mps_available() -> bool:
    """torch built with MPS, running on macOS 12.3+ with an Apple GPU (cheap: no Metal device is created)."""
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and bool(mps.is_available())


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device asked for, else the CPU under ``CVLLM_METAL_ON_CPU``, else MPS (one device: index 0)."""
    if device is not None:
        return torch.device(device)
    return torch.device("cpu") if on_cpu_requested() else torch.device("mps", 0)


def macos_at_least(major: int) -> bool:
    """Whether this is macOS ``major`` or newer (False off macOS)."""
    check = getattr(torch.backends.mps, "is_macos_or_newer", None)
    if check is not None and mps_available():   # raises without an MPS backend, hence the guard
        return bool(check(major, 0))
    release = platform.mac_ver()[0]   # "" off macOS
    return bool(release) and int(release.split(".")[0]) >= major


def bf16_supported(device: torch.device) -> bool:
    """MPS has bfloat16 from macOS 14 (Sonoma: MPSGraph gained the type); before it torch refuses to make such a
    tensor ("MPS BFloat16 is only supported on MacOS 14 or newer"). float16 and float32 work on every macOS torch
    supports."""
    return device.type != "mps" or macos_at_least(14)


def _query(function: Callable[[], int] | None) -> int | None:
    """A torch.mps memory figure, or None where this torch lacks the function or the device refuses."""
    if function is None:
        return None
    try:
        return int(function())
    except RuntimeError:
        return None


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def mps_memory() -> tuple[int, int]:
    """(free, total) bytes the GPU may use of the unified memory.

    total: Metal's ``recommendedMaxWorkingSetSize`` (``torch.mps.recommended_max_memory``, torch 2.5+), what macOS
    lets the GPU keep resident: about two thirds to three quarters of the RAM. Without that figure, two thirds of
    the RAM. free: total minus what the Metal driver holds for this process (``driver_allocated_memory``: the
    weights and torch's cached blocks), or minus the tensors alone (``current_allocated_memory``) where that is
    missing. The rest of macOS shares the same memory and is not counted: ``--mem`` sets the KV pool outright."""
    total = _query(getattr(torch.mps, "recommended_max_memory", None)) or physical_memory() * 2 // 3
    used = _query(getattr(torch.mps, "driver_allocated_memory", None))
    if used is None:
        used = _query(getattr(torch.mps, "current_allocated_memory", None)) or 0
    return max(total - used, 0), total


def host_memory() -> tuple[int, int]:
    """(free, total) host memory, as the CPU backend counts it (the test flag's device)."""
    return CpuBackend().memory()
