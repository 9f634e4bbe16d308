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

Weight prefetch across the boundary (``prefetch_l2``): a weight matmul's weights are not written by the kernels
before it, so its programs may ask the L2 for them before ``griddepcontrol.wait``, while the previous kernel still
runs; the loads after the wait then find them there. A prefetch is only a hint to the L2, which is where every
SM's writes land, so it can never return stale data. For it to start early, the small kernels that run between two
matmuls (the activation quantizer, the split-K sums) let their successor launch before they wait
(``EARLY_LAUNCH``): still correct, as the successor itself waits for them to complete.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from cvllm_cuda.kernels import gpu

EARLY = tl.constexpr(2)   # USE_PDL's value for a kernel that lets its successor launch before it waits
EARLY_LAUNCH = os.environ.get("CVLLM_PDL_EARLY", "1") != "0"
PREFETCH = os.environ.get("CVLLM_PREFETCH", "1") != "0"


@functools.cache
def _enabled(device_index: int) -> bool:
    if triton.knobs.runtime.interpret or os.environ.get("CVLLM_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


_ON, _OFF = {"USE_PDL": True, "launch_pdl": True}, {"USE_PDL": False}
_EARLY = {"USE_PDL": 2, "launch_pdl": True}


def options(device: torch.device, early: bool = False) -> dict:
    """Keyword arguments of a launch on ``device``: the kernel's USE_PDL and Triton's launch_pdl (not to be
    modified: the same dict every call). ``early``: the kernel lets its successor launch before it waits (short
    kernels between weight matmuls, so that the next matmul's prefetch starts while they run)."""
    if device.type != "cuda" or not _enabled(gpu.device_index(device)):
        return _OFF
    return _EARLY if early and EARLY_LAUNCH else _ON


@functools.cache
def prefetch_enabled(device_index: int) -> bool:
    """Whether weight kernels prefetch before waiting (``cp.async.bulk.prefetch`` is sm_90+; CVLLM_PREFETCH=0
    turns it off, an A/B switch)."""
    return PREFETCH and _enabled(device_index)


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Call first in a kernel launched with options(): waits for the previous grid, then lets the next one launch
    (USE_PDL == EARLY: the other way round)."""
    if USE_PDL == EARLY:
        gdc_launch_dependents()
        gdc_wait()
    elif USE_PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Ask the L2 for ``nbytes`` from each of ``ptrs`` (16-byte aligned; ``nbytes`` a multiple of 16). Weights only:
    see the module docstring."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [ptrs, tl.full(ptrs.shape, nbytes, tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
