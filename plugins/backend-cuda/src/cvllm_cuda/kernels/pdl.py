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

# Early inputs (``CVLLM_PDL_EARLY_INPUTS=0`` turns them off): a kernel may read before its wait what no kernel
# still running can be writing: the step's inputs (positions, slots, sequence lengths, block tables), constant tables
# (rotary's cos / sin), and what kernels before its predecessor wrote (the decode attention's cached keys of earlier
# steps). A PDL launch starts only once every program of the kernel before it has passed that kernel's own wait, so
# everything launched before that kernel has finished and its writes are visible; only the predecessor's own writes
# (rotary's keys for the attention, the GEMV's q and k for rotary) are read after the wait. A predecessor launched
# without PDL (a torch op) finishes before the kernel starts at all. The low-bit GEMVs' early weights
# (quant_tiles.EARLY_WEIGHTS) are the same idea for weights.
EARLY_INPUTS = os.environ.get("CVLLM_PDL_EARLY_INPUTS", "1") != "0"


def options(device: torch.device) -> dict:
    """Keyword arguments of a launch on ``device``: the kernel's USE_PDL and Triton's launch_pdl (not to be
    modified: the same dict every call)."""
    return _ON if device.type == "cuda" and _enabled(gpu.device_index(device)) else _OFF


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Call first in a kernel launched with options(): waits for the previous grid, then lets the next one launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
