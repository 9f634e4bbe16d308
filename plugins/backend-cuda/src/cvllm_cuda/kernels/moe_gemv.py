"""The MoE layer of a decode step of one or two tokens in two Triton launches: expert GEMVs.

At batch 1 a Qwen3-30B-A3B layer reads 8 experts' weights (~75 MB) and does nothing else of note; the grouped
GEMM (fused_moe.py) pads each pair to a 16-row tl.dot tile and needs silu_and_mul, a zeroed output and a sum
over the k pairs as three more launches. Here, for up to PAIR_GEMV_MAX pairs:

1. ``_gate_up_gemv``: program (pair, tile) computes BLOCK_N rows of the expert's gate and the same rows of its
   up projection, and stores ``silu(gate) * up`` for them: the activation in the epilogue, no [P, 2I] buffer.
2. ``_down_gemv``: program (token, tile) computes BLOCK_N output features of each of the token's k pairs, times
   its routing weight, and stores their sum: no per-pair output, no second reduction.

The roundings are the grouped GEMM's (torch's): each matmul output to the activations' dtype, silu to the dtype
and its product with up, each pair's product with its weight in the dtype, the k of them summed in float32.
A pair routed to another rank's expert (id >= E_local) adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

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
               NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """Each step loads the same BLOCK_N rows of all k experts at once ([BLOCK_P, BLOCK_N, BLOCK_K]): k times the
    bytes in flight of a pair-at-a-time loop, which left the GPU waiting on small loads."""
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    slots = tl.arange(0, BLOCK_P)
    pairs = token * TOP_K + slots
    experts = tl.load(ids_ptr + pairs, mask=slots < TOP_K, other=NUM_LOCAL)
    here = experts < NUM_LOCAL            # not another rank's expert, not a padding slot
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + tl.where(here, experts, 0).to(tl.int64)[:, None, None] * stride_we
              + rows.to(tl.int64)[None, :, None] * stride_wn + cols[None, None, :])
    x_ptrs = inner_ptr + pairs.to(tl.int64)[:, None] * I + cols[None, :]
    w_ok = here[:, None, None] & row_ok[None, :, None]
    acc = tl.zeros((BLOCK_P, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, I, BLOCK_K):
        k_ok = k + cols < I
        w = tl.load(w_ptrs + k, mask=w_ok & k_ok[None, None, :], other=0.0, eviction_policy="evict_first")
        x = tl.load(x_ptrs + k, mask=here[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[:, None, :]
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2).to(dtype).to(tl.float32)                                  # [BLOCK_P, BLOCK_N]
    weight = tl.load(weights_ptr + pairs, mask=here, other=0.0).to(dtype).to(tl.float32)
    products = (y * weight[:, None]).to(dtype).to(tl.float32)   # exact in float32, rounded as torch's product
    tl.store(out_ptr + token.to(tl.int64) * H + rows, tl.sum(products, axis=0).to(dtype), mask=row_ok)


@dataclass(frozen=True, slots=True)
class GemvTiles:
    """Rows per program and the largest K step of each kernel (bench/moe_gemv_sweep.py measures others)."""
    gate_up_n: int = 1      # gate rows (and as many up rows) a program
    gate_up_k: int = 512
    gate_up_warps: int = 2
    down_n: int = 2         # output features a program, of each of the k experts
    down_k: int = 128
    down_warps: int = 4


# the best of each kernel's sweep on an H200, for Qwen3-30B-A3B and DeepSeek-V2-Lite alike (gate_up 29.2 -> 27.0
# and 33.3 -> 30.7 us a layer; down 29.2 -> 25.0 and 33.2; bench/results/2026-12-02-h200-moe_gemv_sweep-7227f80.json)


DEFAULT_TILES = GemvTiles()


def _block_k(k: int, largest: int) -> int:
    """The K step: the largest power of two up to ``largest`` that divides k (no masks), else ``largest`` masked
    (at most k's next power of two)."""
    step = largest
    while step > 64 and k % step:
        step //= 2
    return step if k % step == 0 else min(largest, next_power_of_2(k))


def moe_gemv(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             local_ids: torch.Tensor, tiles: GemvTiles = DEFAULT_TILES) -> torch.Tensor:
    """fused_moe's result for ``local_ids.numel() <= PAIR_GEMV_MAX`` pairs (shapes as there; hidden contiguous)."""
    tokens, top_k = local_ids.shape
    num_local, two_i, hidden_size = w13.shape
    inter = two_i // 2
    assert w13.stride(2) == 1 and w2.stride(2) == 1 and hidden.stride(1) == 1
    ids = local_ids.reshape(-1)
    inner = torch.empty((tokens * top_k, inter), dtype=hidden.dtype, device=hidden.device)
    block_n, block_k = tiles.gate_up_n, _block_k(hidden_size, tiles.gate_up_k)
    _gate_up_gemv[(ids.shape[0], cdiv(inter, block_n))](
        hidden, w13, ids, inner, inter, hidden_size, hidden.stride(0), w13.stride(0), w13.stride(1),
        inter * w13.stride(1), NUM_LOCAL=num_local, TOP_K=top_k,
        EVEN=inter % block_n == 0 and hidden_size % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        LIBDEVICE_EXP=_LIBDEVICE_EXP, num_warps=tiles.gate_up_warps, num_stages=3, enable_fp_fusion=False,
        **pdl.options(hidden.device))
    out = torch.empty((tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    _down_gemv[(tokens, cdiv(hidden_size, tiles.down_n))](
        inner, w2, ids, topk_weights.reshape(-1), out, hidden_size, inter, w2.stride(0), w2.stride(1),
        NUM_LOCAL=num_local, TOP_K=top_k, BLOCK_P=next_power_of_2(top_k), BLOCK_N=tiles.down_n,
        BLOCK_K=_block_k(inter, tiles.down_k), num_warps=tiles.down_warps, num_stages=3, enable_fp_fusion=False,
        **pdl.options(hidden.device))
    return out
