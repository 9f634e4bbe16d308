"""Matmuls of a few hundred rows (decode batches of 65..256 sequences), ``F.linear(x, weight, bias)``, as
stream-K: one persistent program per SM, each taking an equal share of all the tiles' K steps.

At 256 rows a Llama-3-8B projection is compute-bound, and a tile-per-program GEMM loses to wave quantization:
qkv in 96x128 tiles is 144 tiles on 132 SMs (two waves, the second 12 tiles long), gate_up in 256x128 tiles
224 (1.7 waves). cuBLAS runs them at 500-650 TFLOP/s on an H200 against ~790 for large GEMMs. Here the
(tile, K step) iterations are numbered tile by tile and cut into as many equal contiguous ranges as there
are programs, so every SM does the same work. A tile whose K steps span several programs is summed by the
last of them to get there: each stores its fp32 partial tile in its own workspace slot and counts itself in
with an atomic add; the one whose add completes the count sums the partials in program order (the same sum
every run, whatever the arrival order), writes the output and resets the count. No program waits for
another, so the grid need not be resident at once, and Triton's interpreter (one program after another)
runs it too. A program shares at most two tiles (the first and the last of its range): two slots each.

The counts return to zero as they are consumed, so the kernel is graph-safe with no memset. fp32
accumulation, as cuBLAS's, in another order (a last-bit difference of the rounded output).
Only used where bench/tune_stream_k.py measured it faster than cuBLAS (tuned_matmul.TUNED_STREAM_K).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu, pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv


@dataclass(frozen=True, slots=True)
class StreamKTile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _owner(step, share, extra):
    """The program whose range holds ``step``: the first ``extra`` programs take share + 1 steps, the rest share."""
    long_steps = extra * (share + 1)
    return tl.where(step < long_steps, step // (share + 1), extra + (step - long_steps) // tl.maximum(share, 1))


@triton.jit(do_not_specialize=["num_rows"])
def _stream_k_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    num_rows, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    steps_per_tile = tl.cdiv(K, BLOCK_K)
    total = tiles_m * tl.cdiv(N, BLOCK_N) * steps_per_tile
    share = total // programs
    extra = total % programs          # the first `extra` programs take one step more
    start = pid * share + tl.minimum(pid, extra)
    end = start + share + (pid < extra).to(tl.int32)
    first_tile = start // steps_per_tile
    tile_offsets = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    ks = tl.arange(0, BLOCK_K)
    step = start
    while step < end:
        tile = step // steps_per_tile
        tile_start = tile * steps_per_tile
        stop = tl.minimum(end, tile_start + steps_per_tile)
        # the row tiles of one column of weights are neighbours: a weight tile is read from memory once
        rows = (tile % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < num_rows
        col_ok = cols < N
        k_begin = (step - tile_start) * BLOCK_K
        x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (k_begin + ks)[None, :]
        wt_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + (k_begin + ks)[:, None]   # W^T: [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_begin, (stop - tile_start) * BLOCK_K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                wt = tl.load(wt_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = k + ks < K
                x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                wt = tl.load(wt_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(x, wt, acc, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            wt_ptrs += BLOCK_K
        first = _owner(tile_start, share, extra)
        last = _owner(tile_start + steps_per_tile - 1, share, extra)
        finish = first == last
        if not finish:
            # Shared with other programs: store this partial, count it in; the last to arrive sums them all in
            # program order (the same sum whatever the arrival order) and resets the count. No program waits.
            slot = 2 * pid + (tile != first_tile).to(tl.int32)
            tl.store(part_ptr + slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offsets, acc, cache_modifier=".cg")
            tl.debug_barrier()   # every thread's share of the partial is stored before the count goes up
            finish = tl.atomic_add(count_ptr + tile, 1) == last - first
            if finish:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for q in range(first, last + 1):
                    q_slot = 2 * q + (tile != (q * share + tl.minimum(q, extra)) // steps_per_tile).to(tl.int32)
                    acc += tl.load(part_ptr + q_slot.to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offsets,
                                   cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + tile, 0)
        if finish:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        step = stop


_counts: dict[torch.device, torch.Tensor] = {}


def _count_buffer(device: torch.device, tiles: int) -> torch.Tensor:
    """One int32 arrival count a tile, zero between launches (each tile's last arrival resets its count). Made
    on the first launch outside a CUDA-graph capture, and kept; inside a first capture, a zeroed one per launch."""
    counts = _counts.get(device)
    if counts is None or counts.numel() < tiles:
        counts = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return counts
        _counts[device] = counts
    return counts


def num_programs(device: torch.device) -> int:
    return gpu.num_sms(gpu.device_index(device)) if device.type == "cuda" else 4


def stream_k_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: StreamKTile,
                  programs: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` as a new tensor; ``programs`` defaults to the SM count."""
    n, k = weight.shape
    assert x.shape[-1] == k and weight.stride(1) == 1 and x.dtype == weight.dtype, (x.shape, weight.shape, x.dtype)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    tiles = cdiv(num_rows, config.block_m) * cdiv(n, config.block_n)
    programs = min(programs or num_programs(x.device), tiles * cdiv(k, config.block_k))
    # a program shares at most two tiles with others, the first and the last of its range: two slots
    part = torch.empty((2 * programs, config.block_m * config.block_n), dtype=torch.float32, device=x.device)
    _stream_k_kernel[(programs,)](
        rows, weight, bias if bias is not None else weight, out, part, _count_buffer(x.device, tiles),
        num_rows, n, k, rows.stride(0), weight.stride(0), n,
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.options(x.device),
    )
    return out
