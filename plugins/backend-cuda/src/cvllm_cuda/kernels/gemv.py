"""One-row matmul (GEMV) in one Triton launch: ``F.linear(x, weight, bias)`` for a single token.

A batch-1 decode step is the weights streamed once from memory: for a Llama-3-8B shape 15 GB of the
step's 15.1. cuBLAS picks split-K kernels for the square projections at M = 1 (qkv 3.2 TB/s, o 3.1 TB/s
plus a reduction kernel each, on an H200 whose copy rate is ~4.1-4.3 TB/s). Here each program owns
BLOCK_N output features and walks the whole K range: no split, no second kernel, one fp32 accumulator
tile per program, reduced once at the end. The weight is read with an evict-first hint (it is used once
a step and would only push the activations and KV blocks out of L2).

The sum order differs from cuBLAS's (fp32 accumulation both), a last-bit effect on the rounded output,
like the fused RMSNorm's sum of squares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu, pdl, quant_tiles
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.kernels.tuned_matmul import TUNED_GEMV


@dataclass(frozen=True, slots=True)
class MatmulTile:
    """A program's share of a matmul (the GEMV's and the skinny GEMM's): output features x a K step."""
    block_n: int      # output features per program
    block_k: int      # input features per step of the K loop
    num_warps: int
    num_stages: int
    split_k: int = 1  # skinny GEMM only: K cut into this many slices, their fp32 partials summed by a second kernel


# a sweep on an H200 (bench/results/2026-12-01-h200-tune_gemv-5817599.json): four rows a program stream the
# Llama-3-8B projections at 3.4-4.4 TB/s
DEFAULT_CONFIG = MatmulTile(block_n=4, block_k=1024, num_warps=2, num_stages=3)


@triton.jit
def _weight_step(w_ptrs, k, cols, row_ok, K, EVEN: tl.constexpr):
    """The weight tile of the K step at ``k`` (read once a step: evict-first)."""
    if EVEN:
        return tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        k_ok = k + cols < K
        return tl.load(w_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def _step(acc, w, x_ptr, k, cols, K, EVEN: tl.constexpr):
    """``acc`` plus the K step at ``k``: its weights ``w`` times x's slice."""
    if EVEN:
        x = tl.load(x_ptr + k + cols)
    else:
        x = tl.load(x_ptr + k + cols, mask=k + cols < K, other=0.0)
    return acc + w.to(tl.float32) * x.to(tl.float32)[None, :]


@triton.jit
def _row_factors(scale_ptr, bias_ptr, rows, row_ok, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(scale, bias) of output rows ``rows`` as float32 (zeros where the kernel has none)."""
    scale = tl.zeros(rows.shape, tl.float32)
    bias = tl.zeros(rows.shape, tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    return scale, bias


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr,
    N, K, stride_wn,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr, EARLY: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < N
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # the rows' scales and bias first, not after the K loop, where their load was one more round trip to memory at
    # the end of every program; with EARLY before the PDL wait, with the first K step's weights
    # (quant_tiles.EARLY_WEIGHTS: no kernel writes weights)
    if EARLY:
        w = _weight_step(w_ptrs, 0, cols, row_ok, K, EVEN)
        scale, bias = _row_factors(scale_ptr, bias_ptr, rows, row_ok, HAS_SCALE, HAS_BIAS)
    wait_for_previous_kernel(USE_PDL)
    if not EARLY:
        scale, bias = _row_factors(scale_ptr, bias_ptr, rows, row_ok, HAS_SCALE, HAS_BIAS)
    if EARLY:
        acc = _step(acc, w, x_ptr, 0, cols, K, EVEN)
        w_ptrs += BLOCK_K
    for k in range(BLOCK_K * EARLY, K, BLOCK_K):
        acc = _step(acc, _weight_step(w_ptrs, k, cols, row_ok, K, EVEN), x_ptr, k, cols, K, EVEN)
        w_ptrs += BLOCK_K
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:   # FP8 weights: one float32 scale per output row
        y *= scale
    if HAS_BIAS:
        y += bias
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


def tiles(table: dict[str, dict[tuple, tuple[int, ...]]]) -> dict[str, dict[tuple, MatmulTile]]:
    """A committed table of tuned_matmul.py with its values as tiles (converted once, not per launch)."""
    return {name: {key: MatmulTile(*value) for key, value in entries.items()} for name, entries in table.items()}


GEMV_TILES = tiles(TUNED_GEMV)


def gemv_config(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device) -> MatmulTile:
    """The tile for this weight shape: a tuned entry for this GPU (tuned_matmul.py) or the default."""
    tuned = gpu.tuned_entry(GEMV_TILES, device, (out_features, in_features, str(dtype).removeprefix("torch.")))
    return DEFAULT_CONFIG if tuned is None else tuned


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: MatmulTile | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for an ``x`` of one row (``[K]``, ``[1, K]``, ``[1, 1, K]`` ...) as a new
    tensor of ``x``'s leading shape: a contiguous ``weight [N, K]`` (its rows may be strided) and x's dtype.
    ``scale`` (float32 [N]): an FP8 e4m3 weight's per-row scales, ``F.linear(x, weight * scale[:, None])``."""
    n, k = weight.shape
    assert x.shape[-1] == k and x.numel() == k, (x.shape, weight.shape)
    fp8 = weight.dtype == torch.float8_e4m3fn and scale is not None
    assert weight.stride(1) == 1 and (fp8 or x.dtype == weight.dtype), (weight.stride(), x.dtype, weight.dtype)
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    cfg = config or gemv_config(n, k, weight.dtype, weight.device)
    x = x.reshape(k)
    if x.stride(0) != 1:
        x = x.contiguous()
    even = n % cfg.block_n == 0 and k % cfg.block_k == 0
    _gemv_kernel[(cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, scale if scale is not None else weight, out, n, k,
        weight.stride(0), HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, EVEN=even, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, EARLY=quant_tiles.EARLY_WEIGHTS,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(x.device),
    )
    return out

