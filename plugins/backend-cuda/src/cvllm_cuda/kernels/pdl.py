"""Programmatic dependent launch (PDL, Hopper and later) for the backend's Triton kernels.

A decode step at batch 1 is ~400 short kernels back to back; between two of them the GPU drains the first
(its last wave, then a memory flush) before it even starts scheduling the second. With PDL the next kernel
is launched while the previous one finishes: its programs are placed on the SMs and wait at
``griddepcontrol.wait`` until the previous grid has completed and its writes are visible. Each kernel
waits first thing, before it reads or writes anything, so nothing can see a half-written input or
overwrite memory the previous kernel still reads; then it lets its own successor launch. A kernel whose
predecessor is an ordinary launch (a torch op) waits for nothing. CUDA-graph capture keeps the edges.

CVLLM_PDL=0 turns it off (an A/B switch); GPUs before compute capability 9.0 and Triton's interpreter
never use it.

CVLLM_PDL_LATE_TRIGGER=1 (an experiment, off by default): the add + RMSNorm and the split-KV combination let their
successor launch only once their own inputs are in (``LATE_TRIGGER``), not first thing. At batch 1 their successor
is a GEMV whose hundreds of programs read their first weights as soon as they are placed; those reads may queue
ahead of the small kernel's own few loads (a norm spans ~2.9 us of the step's critical path against 1.4 alone in a
chain, and the combination went 4.0 -> 2.7 us when the GEMV after it ran fewer programs, session 44).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cvllm_cuda.kernels import gpu


@functools.cache
def _enabled(device_index: int) -> bool:
    if triton.knobs.runtime.interpret or os.environ.get("CVLLM_PDL", "1") == "0":
        return False
    return gpu.capability(device_index)[0] >= 9


_ON, _OFF = {"USE_PDL": True, "launch_pdl": True}, {"USE_PDL": False}
LATE_TRIGGER = os.environ.get("CVLLM_PDL_LATE_TRIGGER", "0") == "1"   # read at import, as the other switches


def options(device: torch.device) -> dict:
    """Keyword arguments of a launch on ``device``: the kernel's USE_PDL and Triton's launch_pdl (not to be
    modified: the same dict every call)."""
    return _ON if device.type == "cuda" and _enabled(gpu.device_index(device)) else _OFF


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr, LATE: tl.constexpr = False):
    """Call first in a kernel launched with options(): waits for the previous grid, then lets the next one launch
    (with ``LATE`` the kernel does that itself later: ``launch_next_kernel``)."""
    if USE_PDL:
        gdc_wait()
        if not LATE:
            gdc_launch_dependents()


@triton.jit
def launch_next_kernel(USE_PDL: tl.constexpr, LATE: tl.constexpr):
    """With ``LATE``: lets the next grid launch (once every program has called it or exited). Call it after a store
    that needs the kernel's inputs, so that it cannot be issued before they are in."""
    if USE_PDL and LATE:
        gdc_launch_dependents()
