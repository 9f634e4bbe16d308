"""The MoE layer of a decode step of one or two tokens in two Triton launches: expert GEMVs.

At batch 1 a Qwen3-30B-A3B layer reads 8 experts' weights (~75 MB) and does nothing else of note; the grouped
GEMM (fused_moe.py) pads each pair to a 16-row tl.dot tile and needs silu_and_mul, a zeroed output and a sum
over the k pairs as three more launches. Here, for up to PAIR_GEMV_MAX pairs:

1. ``_gate_up_gemv``: program (pair, tile) computes BLOCK_N rows of the expert's gate and the same rows of its
   up projection, and stores ``silu(gate) * up`` for them: the activation in the epilogue, no [P, 2I] buffer.
2. ``_down_gemv``: program (token, tile) walks the token's k pairs, each pair's BLOCK_N output features times
   its routing weight, and stores their sum: no per-pair output, no second reduction.

The roundings are the grouped GEMM's (torch's): each matmul output to the activations' dtype, silu to the dtype
and its product with up, each pair's product with its weight in the dtype, the k of them summed in float32.
A pair routed to another rank's expert (id >= E_local) adds nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

PAIR_GEMV_MAX = 16   # (token, expert) pairs: a decode step of one or two tokens
_LIBDEVICE_EXP = not triton.knobs.runtime.interpret   # the interpreter has no libdevice


@triton.jit
def _gate_up_gemv(x_ptr, w_ptr, ids_ptr, out_ptr, I, K, stride_xt, stride_we, stride_wn, up_offset,
                  NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, LIBDEVICE_EXP: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if expert >= NUM_LOCAL:   # another rank's expert: the down GEMV skips this pair
        return
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    cols = tl.arange(0, BLOCK_K)
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    up_ptrs = gate_ptrs + up_offset   # the up rows: I rows below the gate rows
    x_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xt + cols
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptrs + k).to(tl.float32)[None, :]
            gate = tl.load(gate_ptrs + k, eviction_policy="evict_first")
            up = tl.load(up_ptrs + k, eviction_policy="evict_first")
        else:
            k_ok = k + cols < K
            mask = row_ok[:, None] & k_ok[None, :]
            x = tl.load(x_ptrs + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            gate = tl.load(gate_ptrs + k, mask=mask, other=0.0, eviction_policy="evict_first")
            up = tl.load(up_ptrs + k, mask=mask, other=0.0, eviction_policy="evict_first")
        acc_gate += gate.to(tl.float32) * x
        acc_up += up.to(tl.float32) * x
    dtype = out_ptr.dtype.element_ty
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    # silu as torch computes it (activation.py): gate / (1 + exp(-gate)) with libdevice's exp, rounded
    exp_neg = libdevice.exp(-gate) if LIBDEVICE_EXP else tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp_neg).to(dtype).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * I + rows, (silu * up).to(dtype), mask=row_ok)


@triton.jit
def _down_gemv(inner_ptr, w_ptr, ids_ptr, weights_ptr, out_ptr, H, I, stride_we, stride_wn,
               NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    cols = tl.arange(0, BLOCK_K)
    dtype = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        expert = tl.load(ids_ptr + pair)
        here = expert < NUM_LOCAL
        w_ptrs = (w_ptr + tl.where(here, expert, 0).to(tl.int64) * stride_we
                  + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :])
        x_ptrs = inner_ptr + pair.to(tl.int64) * I + cols
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, I, BLOCK_K):
            k_ok = (k + cols < I) & here
            w = tl.load(w_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs + k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1).to(dtype).to(tl.float32)
        weight = tl.load(weights_ptr + pair).to(dtype).to(tl.float32)
        total += (y * weight).to(dtype).to(tl.float32)   # exact in float32, then rounded as torch's product
    tl.store(out_ptr + token.to(tl.int64) * H + rows, total.to(dtype), mask=row_ok)


def _block_k(k: int) -> int:
    """The K step: the largest power of two up to 1024 that divides k (no masks), else 1024 masked."""
    step = 1024
    while step > 64 and k % step:
        step //= 2
    return step if k % step == 0 else min(1024, next_power_of_2(k))


def moe_gemv(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             local_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe's result for ``local_ids.numel() <= PAIR_GEMV_MAX`` pairs (shapes as there; hidden contiguous)."""
    tokens, top_k = local_ids.shape
    num_local, two_i, hidden_size = w13.shape
    inter = two_i // 2
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and hidden.stride(1) == 1
    ids = local_ids.reshape(-1)
    inner = torch.empty((tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    block_k = _block_k(hidden_size)
    _gate_up_gemv[(ids.shape[0], cdiv(inter, 2))](
        hidden, w13, ids, inner, inter, hidden_size, hidden.stride(0), w13.stride(0), w13.stride(1),
        inter * w13.stride(1),
        NUM_LOCAL=num_local, TOP_K=top_k, EVEN=inter % 2 == 0 and hidden_size % block_k == 0, BLOCK_N=2,
        BLOCK_K=block_k, LIBDEVICE_EXP=_LIBDEVICE_EXP, num_warps=4, num_stages=3, enable_fp_fusion=False,
        **pdl.options(hidden.device))
    out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _down_gemv[(tokens, cdiv(hidden_size, 2))](
        inner, w2, ids, topk_weights.reshape(-1), out, hidden_size, inter, w2.stride(0), w2.stride(1),
        NUM_LOCAL=num_local, TOP_K=top_k, BLOCK_N=2, BLOCK_K=_block_k(inter), num_warps=2, num_stages=3,
        enable_fp_fusion=False, **pdl.options(hidden.device))
    return out
