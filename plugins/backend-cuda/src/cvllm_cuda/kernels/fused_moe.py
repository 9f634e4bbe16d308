"""The mixture-of-experts layer on CUDA: a grouped GEMM over the (token, expert) pairs sorted by expert.

``fused_moe`` computes what core's UnquantizedFusedMoEMethod computes (layers/fused_moe_methods.py: each pair's
``down(silu(gate) * up)`` times its routing weight, summed per token) in four launches of work and no host sync,
so a CUDA graph captures it. Decode steps of up to PAIR_GEMV_MAX pairs take moe_gemv.py's two expert GEMVs
instead (no padded tl.dot tiles, silu and the sum over k fused); the grouped GEMM below serves larger batches, and
its block-per-pair form (PAIR_BLOCKS_MAX) the low-bit experts of fused_moe_planes.py:

1. ``align_pairs`` (torch ops on the device): the pairs sorted by local expert, each expert's run padded to a
   multiple of BLOCK_M with a "no pair" marker, and each BLOCK_M block's expert; a pair routed to an expert
   another rank holds (expert parallelism) is left out. Sized for the worst case (every expert's run padded), so
   the shapes depend on the token count only; blocks past the used ones find no expert and return at once. Up to
   PAIR_BLOCKS_MAX pairs (decode steps of a token or two) each pair is a block instead: nothing to sort.
2. ``_moe_gemm`` for gate_up: block b multiplies the hidden rows of its pairs' tokens by its expert's
   ``w13 [2I, H]``: only the routed experts' weights are read (the torch path on CUDA ran every expert on every
   token so as not to sync: E / k times the reads at batch 1).
3. silu(gate) * up (the backend's kernel).
4. ``_moe_gemm`` for down, each row scaled by its pair's routing weight; the k rows of a token are then summed.

float32 sums; the roundings of the torch path (each matmul's output and the product with the weight in the
activations' dtype), summed over k in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.moe_gemv import PAIR_GEMV_MAX, moe_gemv
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel

# up to this many (token, expert) pairs, each pair is a block of its own: no sorting at all (a decode step of one
# or two tokens: ~16 fewer launches a layer), at the price of reading an expert twice when two pairs share it
PAIR_BLOCKS_MAX = 16
_pair_blocks: dict[tuple, torch.Tensor] = {}


def pair_blocks(pairs: int, block_m: int, device: torch.device) -> torch.Tensor:
    """int32 [pairs * block_m]: block b holds pair b and then "no pair" markers (made once per size and device,
    outside any CUDA graph: the engine runs each decode shape eagerly before capturing it)."""
    key = (pairs, block_m, str(device))
    if key not in _pair_blocks:
        rows = torch.full((pairs, block_m), pairs, dtype=torch.int32, device=device)
        rows[:, 0] = torch.arange(pairs, dtype=torch.int32, device=device)
        _pair_blocks[key] = rows.reshape(-1)
    return _pair_blocks[key]


def pair_layout(local_ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(pairs by block, each block's expert, BLOCK_M) for routing ``local_ids [T, k]``: a block per pair up to
    PAIR_BLOCKS_MAX pairs (its expert the pair's own; num_local: none here, skipped), else align_pairs."""
    pairs = local_ids.numel()
    block_m = 16 if pairs <= 8 * num_local else 64   # a few pairs an expert: the smallest tl.dot tile
    if pairs <= PAIR_BLOCKS_MAX:
        return pair_blocks(pairs, block_m, local_ids.device), local_ids.reshape(-1), block_m
    return *align_pairs(local_ids.reshape(-1), num_local, block_m), block_m


def align_pairs(local_ids: torch.Tensor, num_local: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``local_ids`` int64 [P] (a pair's expert on this rank; ``num_local``: another rank's) -> (the pairs in
    expert order, padded per expert to whole blocks with P, int32 [max_blocks * block_m]; each block's expert,
    ``num_local`` for the unused ones, int32 [max_blocks])."""
    pairs, device = local_ids.shape[0], local_ids.device
    max_blocks = triton.cdiv(pairs + num_local * (block_m - 1), block_m)
    ids = local_ids.clamp(max=num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = torch.cat([ends.new_zeros(1), ends])                  # [num_local + 1]; the last: past every run
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    first_of_expert = counts.cumsum(0) - counts
    slot = starts[sorted_ids] + torch.arange(pairs, device=device) - first_of_expert[sorted_ids]
    slot = torch.where(sorted_ids < num_local, slot, max_blocks * block_m)   # another rank's pair: dropped
    sorted_pairs = torch.full((max_blocks * block_m + 1,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    return sorted_pairs[:-1], block_expert


@triton.jit
def _moe_gemm(a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr, N, K, P,
              stride_am, stride_we, stride_wn, stride_om,
              NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr, ROWS_BY_TOKEN: tl.constexpr, SCALE_ROWS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
              USE_PDL: tl.constexpr):
    """out[pair, n-tile] = a[row of pair] @ w[expert of the block]^T for the BLOCK_M pairs of block pid 0 (row:
    the pair's token with ROWS_BY_TOKEN, else the pair itself); SCALE_ROWS: times the pair's routing weight."""
    wait_for_previous_kernel(USE_PDL)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_LOCAL:   # past the used blocks
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < P
    rows = (pairs // TOP_K if ROWS_BY_TOKEN else pairs).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + (k0 + ks)[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_base + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)   # [BLOCK_K, N]
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    if SCALE_ROWS:   # as the torch path: the expert's output and the weight in the activations' dtype
        weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(out_ptr.dtype.element_ty)
        out = out * weight[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :], out,
             mask=pair_ok[:, None] & col_ok[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
          block_expert: torch.Tensor, weights: torch.Tensor, top_k: int, rows_by_token: bool, block_m: int) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = 64, 64 if a.dtype != torch.float32 else 32
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _moe_gemm[grid](a, w, out, sorted_pairs, block_expert, weights, n, k, out.shape[0], a.stride(0), w.stride(0),
                    w.stride(1), out.stride(0), NUM_LOCAL=w.shape[0], TOP_K=top_k, ROWS_BY_TOKEN=rows_by_token,
                    SCALE_ROWS=not rows_by_token, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                    DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3,
                    **pdl.options(a.device))


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              local_ids: torch.Tensor, silu_and_mul) -> torch.Tensor:
    """The experts' weighted sum ``[T, H]`` for ``hidden [T, H]``, ``w13 [E_local, 2I, H]`` (gate rows, then up),
    ``w2 [E_local, H, I]``, routing ``topk_weights`` / ``local_ids`` [T, k] (E_local: another rank's expert,
    adding nothing here)."""
    tokens, top_k = local_ids.shape
    num_local = w13.shape[0]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if tokens * top_k <= PAIR_GEMV_MAX:   # a decode step of a token or two: two expert GEMVs (moe_gemv.py)
        return moe_gemv(hidden, w13, w2, topk_weights, local_ids)
    sorted_pairs, block_expert, block_m = pair_layout(local_ids, num_local)
    weights = topk_weights.reshape(-1).float()
    gate_up = torch.empty((tokens * top_k, w13.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _gemm(hidden, w13, gate_up, sorted_pairs, block_expert, weights, top_k, True, block_m)
    inner = silu_and_mul(gate_up)
    # rows of pairs no expert here ran stay zero: another rank's experts, summed in the all-reduce
    down = torch.zeros((tokens * top_k, w2.shape[1]), dtype=hidden.dtype, device=hidden.device)
    _gemm(inner, w2, down, sorted_pairs, block_expert, weights, top_k, False, block_m)
    return down.view(tokens, top_k, -1).sum(dim=1)
