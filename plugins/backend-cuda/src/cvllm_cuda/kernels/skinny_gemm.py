"""Matmuls of a few rows (2..64 tokens: decode batches) in one Triton launch, ``F.linear(x, weight, bias)``.

At these sizes a matmul is the weight streamed from memory once, like the one-token GEMV; cuBLAS's kernels
for them read a Llama-3-8B projection at 2.8-3.8 TB/s on an H200 (copy rate ~4.2). Each program here owns
BLOCK_N output features and all rows: it computes ``W_tile @ x^T`` (features x rows), so the weight tile is
the tensor cores' M side and the few rows their N side (the "swap AB" layout of skinny GEMMs), and walks the
whole K range with the loads pipelined over num_stages: N / BLOCK_N programs. Where that is too few for the
GPU's SMs (a 4096-wide layer in 64-feature tiles is 64 programs), ``split_k`` cuts K into slices, one program
each, and a second small kernel sums their fp32 partials in a fixed order (deterministic, as cuBLAS's split-K).

Only used where bench/tune_matmul.py measured it faster than cuBLAS on this GPU (tuned_matmul.TUNED_SKINNY);
fp32 accumulation, as cuBLAS's, in another order (a last-bit difference of the rounded output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.gemv import MatmulTile
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

MIN_BLOCK_M = 16  # tl.dot's smallest operand side
SUM_BLOCK = 1024  # outputs per program of the split-K sum


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr,
    num_rows, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    features = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:  # the whole K range (kept literal: the unsplit kernel compiles as it was tuned)
        k_begin = 0
        k_end = K
    else:  # this program's K slice: whole BLOCK_K steps (the last slices may be short or empty)
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_begin = tl.program_id(1) * k_per_split
        k_end = tl.minimum(K, k_begin + k_per_split)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    feature_ok = features < N
    row_ok = rows < num_rows
    w_ptrs = w_ptr + features.to(tl.int64)[:, None] * stride_wn + (k_begin + ks)[None, :]
    xt_ptrs = x_ptr + rows.to(tl.int64)[None, :] * stride_xm + (k_begin + ks)[:, None]   # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=feature_ok[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(xt_ptrs, mask=row_ok[None, :], other=0.0)
        else:
            k_ok = k + ks < K
            w = tl.load(w_ptrs, mask=feature_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(xt_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
    keep = feature_ok[:, None] & row_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + features, mask=feature_ok, other=0.0).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rows.to(tl.int64)[None, :] * stride_om + features[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=keep)
    else:  # partials [SPLIT_K, rows, N] in fp32, for _sum_splits_kernel
        part = (tl.program_id(1) * num_rows + rows.to(tl.int64))[None, :] * N + features[:, None]
        tl.store(part_ptr + part, acc, mask=keep)


@triton.jit
def _sum_splits_kernel(part_ptr, bias_ptr, out_ptr, num_rows, N, stride_om, HAS_BIAS: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)   # row * N + feature
    ok = flat < num_rows * N
    total = tl.load(part_ptr + flat, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):   # in slice order: the same sum every run
        total += tl.load(part_ptr + s * num_rows * N + flat, mask=ok, other=0.0)
    feature = flat % N
    if HAS_BIAS:
        total += tl.load(bias_ptr + feature, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (flat // N) * stride_om + feature, total.to(out_ptr.dtype.element_ty), mask=ok)


def block_m(num_rows: int) -> int:
    """The row tile of ``num_rows`` rows: a power of two, at least MIN_BLOCK_M (also the tuned table's key)."""
    return max(MIN_BLOCK_M, next_power_of_2(num_rows))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: MatmulTile) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x [..., K]`` of at most a few dozen rows, as a new tensor."""
    n, k = weight.shape
    assert x.shape[-1] == k and weight.stride(1) == 1 and x.dtype == weight.dtype, (x.shape, weight.shape, x.dtype)
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    split = config.split_k
    part = torch.empty((split, num_rows, n), dtype=torch.float32, device=x.device) if split > 1 else out
    launch = pdl.options(x.device)
    _skinny_gemm_kernel[(cdiv(n, config.block_n), split)](
        rows, weight, bias if bias is not None else weight, out, part,
        num_rows, n, k, rows.stride(0), weight.stride(0), n,
        HAS_BIAS=bias is not None, EVEN_K=k % config.block_k == 0, BLOCK_M=block_m(num_rows),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **launch,
    )
    if split > 1:
        _sum_splits_kernel[(cdiv(num_rows * n, SUM_BLOCK),)](
            part, bias if bias is not None else weight, out, num_rows, n, n,
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=SUM_BLOCK, num_warps=4, **launch,
        )
    return out
