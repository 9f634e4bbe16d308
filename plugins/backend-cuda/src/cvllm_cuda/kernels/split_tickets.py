"""K splits added in a kernel's own launch by the split that finishes last: the MMA GEMV's FUSED_SUM (on by
default; ``CVLLM_IN_LAUNCH_SPLIT_SUMS=0`` turns it off) and the swapped GEMM's (off by default; ``=1`` turns both on).

Why: a split product is otherwise followed by sum_splits_kernel, one more launch a projection. At batch 1 the MMA
GEMV splits all four of a layer's projections: on the H200 128 such launches a GPTQ step, 4.4 us each on the
critical path, 0.56 ms of a 2.71 ms step (docs/benchmarks.md, session 40); at 64 rows the swapped GEMM splits them
too (an H200 q4k profile of 64 streams, 2026-12-04: 128 launches, 0.48 ms of an 8.4 ms step).

Each split stores its float32 partial sums as before, then takes a ticket on its output tile's counter: a barrier
(every thread's stores issued), then one atomic add at GPU scope that releases them; the split drawing the last
ticket acquires them all as it resets the counter. That one reads the partials back through L2 and adds them in split
order from zero, as sum_splits_kernel does (the same bits), CHUNK splits' loads issued together (session 31's
version loaded one split after another, one L2 round trip each, and lost), and stores the output. The counters are
zero between launches: a kernel launched with PDL touches them only after it has waited for the one before (pdl.py),
and the engine runs a device's kernels on one stream.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Timed on the H100 (2026-12-06, docs/benchmarks.md session 41): batch-1 --isq gptq 351.9 -> 377.4 tok/s with the
# MMA GEMV's; 64 streams of 1024/1024 with the swapped GEMM's q4k 5,229 -> 5,240 and gptq 5,542 -> 5,483 (no gain:
# at 64 rows its tiles are few and long, and the sum launches a small part of a step)
_SWITCH = os.environ.get("CVLLM_IN_LAUNCH_SPLIT_SUMS", "")
ENABLED = _SWITCH != "0"         # the MMA GEMV's
SWAPPED_ENABLED = _SWITCH == "1"  # the swapped GEMM's
SLOTS = 1 << 14   # output tiles a launch may have (Llama-3-8B's gate_up: 224 of the MMA GEMV's 128 features)
_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed int32 ticket counters of ``device`` for a launch of ``tiles`` output tiles, or None: too many tiles,
    or none allocated yet while a CUDA graph is being captured (the engine runs each shape eagerly before capturing
    it, which allocates them)."""
    if tiles > SLOTS:
        return None
    found = _counters.get(device)
    if found is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        found = _counters[device] = torch.zeros(SLOTS, dtype=torch.int32, device=device)
    return found


def launch_tickets(device: torch.device, tiles: int, splits: int, wanted: bool | None,
                   default: bool) -> torch.Tensor | None:
    """The counters a launch of ``tiles`` output tiles in ``splits`` K splits adds its splits with (its FUSED_SUM),
    or None: one split, not ``wanted`` (None: ``default``, the kernel's switch), or no counters (``counters``); then
    sum_splits_kernel adds them after it."""
    if splits == 1 or not (default if wanted is None else wanted):
        return None
    return counters(device, tiles)


@triton.jit
def last_split(counters_ptr, tile, splits):
    """Whether this program is the last of its output tile's ``splits`` K splits to have stored its partial sums
    (then the counter is zero again). Call after the program's partial stores. Every split releases its stores with
    its ticket; only the last acquires them, with the exchange that resets the counter (it reads the end of the
    tickets' chain of adds), so the others end without an acquire (an L1 invalidation in the SASS)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counters_ptr + tile, 1, sem="release", scope="gpu")
    last = ticket == splits - 1
    if last:
        tl.atomic_xchg(counters_ptr + tile, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()   # every thread's reads of the partials after the acquire
    return last


@triton.jit
def summed_splits(ptrs, ok, split_stride, SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    """float32: the partial sums at ``ptrs + j * split_stride`` (mask ``ok``) for j < SPLITS added in split order from
    zero (sum_splits_kernel's order: the same bits; a masked split past SPLITS adds +0.0, and a sum from +0.0 is never
    -0.0), read through L2 (``.cg``: other SMs wrote them). CHUNK splits are loaded at a time, in a loop the compiler
    keeps: unrolled whole, 32 splits took the MMA GEMV from 80 registers to 172 and 64 spilled, the main loop's
    occupancy with them."""
    total = tl.zeros(ptrs.shape, dtype=tl.float32)
    for j0 in tl.range(0, SPLITS, CHUNK, loop_unroll_factor=1):
        for jj in tl.static_range(CHUNK):
            total += tl.load(ptrs + (j0 + jj) * split_stride, mask=ok & (j0 + jj < SPLITS), other=0.0,
                             cache_modifier=".cg")
    return total
