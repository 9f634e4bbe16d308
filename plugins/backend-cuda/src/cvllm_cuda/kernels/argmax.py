"""Row-wise argmax of the logits (greedy sampling) in two short Triton launches.

torch's argmax reduces a row with one block: a [1, 128k] row takes ~28 µs on an H200, half a percent of a
batch-1 decode step. Here programs reduce chunks of every row in parallel (value and first index of each
chunk's max), and one program a row picks the first chunk holding the largest value: torch's answer, the
first index of the maximum, where a NaN outranks every number (torch's rule too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

CHUNK = 4096


@triton.jit
def _chunk_argmax_kernel(x_ptr, values_ptr, indices_ptr, vocab, stride_x, num_chunks,
                         CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    best = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    first = tl.min(tl.where(x == best, cols, vocab), axis=0)
    first_nan = tl.min(tl.where(is_nan, cols, vocab), axis=0)
    # a chunk holding a NaN reports NaN at its first one: NaN outranks every number, as in torch
    tl.store(values_ptr + row * num_chunks + chunk, tl.where(first_nan < vocab, float("nan"), best))
    tl.store(indices_ptr + row * num_chunks + chunk, tl.where(first_nan < vocab, first_nan, first))


@triton.jit
def _row_argmax_kernel(values_ptr, indices_ptr, out_ptr, reported_ptr, num_chunks, BLOCK_C: tl.constexpr,
                       REPORT: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    ok = chunks < num_chunks
    values = tl.load(values_ptr + row * num_chunks + chunks, mask=ok, other=float("-inf"))
    indices = tl.load(indices_ptr + row * num_chunks + chunks, mask=ok, other=2**31 - 1)
    is_nan = values != values
    best = tl.max(tl.where(is_nan, float("-inf"), values), axis=0)
    first = tl.min(tl.where(values == best, indices, 2**31 - 1), axis=0)
    first_nan = tl.min(tl.where(is_nan, indices, 2**31 - 1), axis=0)
    token = tl.where(first_nan < 2**31 - 1, first_nan, first).to(tl.int64)
    tl.store(out_ptr + row, token)
    if REPORT:   # -1 for a row whose logits hold NaN or +inf (the sampler's "not finite"; -inf is a masked token)
        tl.store(reported_ptr + row, tl.where((first_nan < 2**31 - 1) | (best == float("inf")), -1, token))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of ``[B, V]`` logits (any float dtype, rows contiguous): int64 ``[B]``."""
    return _argmax(logits, False)[0]


def argmax_reported(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``argmax`` and, from the same launches, the ids the host is told: -1 where a row's logits hold NaN or +inf
    (what the sampler's greedy path otherwise computes with three more ops a step: amax, compare, where)."""
    return _argmax(logits, True)


def _argmax(logits: torch.Tensor, report: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and vocab < 2**31 - 1, (logits.stride(), vocab)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    reported = torch.empty(rows, dtype=torch.int64, device=logits.device) if report else None
    if rows == 0:
        return out, reported
    num_chunks = cdiv(vocab, CHUNK)
    values = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    launch = pdl.options(logits.device)
    _chunk_argmax_kernel[(rows, num_chunks)](logits, values, indices, vocab, logits.stride(0), num_chunks,
                                             CHUNK=CHUNK, num_warps=8, **launch)
    _row_argmax_kernel[(rows,)](values, indices, out, out if reported is None else reported, num_chunks,
                                BLOCK_C=max(2, next_power_of_2(num_chunks)), REPORT=report, num_warps=1, **launch)
    return out, reported
