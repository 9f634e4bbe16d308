"""The fused MoE (kernels/fused_moe.py) over low-bit experts: each expert's weights in the plane layout of
quant_planes.py (GGUF blocks, GPTQ groups, in-situ quantized), stacked on a leading expert dimension, and
dequantized in the tile as the grouped GEMM reads them (the dot GEMM of quant_matmul.py with an expert per block).

A Q4_K expert of Qwen3-30B-A3B is ~2.6 MB instead of 9.4 in bf16: a 4-bit file's experts stay ~4-bit on the GPU.
``fused_moe_planes`` takes gate/up as parts (GGUF files may store gate and up in different types, like Q4_K_M's
mixes), each a GEMM into its columns of the gate_up rows. The layers that hold such experts come next (issue 19):
this is the kernel and its reference test.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import moe_gemv, pdl
from cvllm_cuda.kernels.fused_moe import pair_layout
from cvllm_cuda.kernels.moe_planes_gemv import moe_planes_gemv
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_tiles import dot_into, dot_unpacked, quant_element, run_or_fall_back, tile, upcast
from cvllm_cuda.quant_planes import QuantWeight

_PLANES = ("low", "high", "d", "m", "a", "b")
# Decode steps of up to this many (token, expert) pairs take the expert GEMVs of moe_planes_gemv.py (on the H200 a
# Qwen3-30B-A3B layer's Q4_K experts 49.5 -> 40.1 us, GPTQ 68.7 -> 29.4; docs/benchmarks.md);
# CVLLM_MOE_PLANES_GEMV=0 keeps the grouped GEMM for every step
PAIR_GEMV_MAX = moe_gemv.PAIR_GEMV_MAX if os.environ.get("CVLLM_MOE_PLANES_GEMV", "1") == "1" else 0


def stack_experts(experts: list[QuantWeight]) -> QuantWeight:
    """One QuantWeight whose tensors have a leading expert dimension ([E, ...]): same layout and shape each."""
    first = experts[0]
    if any(e.layout != first.layout or (e.out_features, e.in_features) != (first.out_features, first.in_features)
           for e in experts):
        raise ValueError("experts of one layer must share their layout and shape")
    stacked = {name: torch.stack([getattr(e, name) for e in experts]) if getattr(first, name) is not None else None
               for name in _PLANES}
    return QuantWeight(first.layout, first.out_features, first.in_features, **stacked)


@triton.jit
def _moe_planes_gemm(a_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr, perm_ptr,
                     low_ptr, high_ptr, d_ptr, m_ptr, fa_ptr, fb_ptr,
                     stride_low, stride_high, stride_d, stride_m, stride_fa, stride_fb,
                     N, K, P, stride_am, stride_om, col_offset,
                     LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                     SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                     HAS_M: tl.constexpr, FLOAT8: tl.constexpr, NUM_LOCAL: tl.constexpr, TOP_K: tl.constexpr,
                     ROWS_BY_TOKEN: tl.constexpr, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                     HAS_PERM: tl.constexpr, UNPACKED: tl.constexpr, USE_PDL: tl.constexpr):
    """out[pair, col_offset + n-tile] = a[row of pair] @ W[expert of the block]^T, W dequantized in the tile, a K
    step at a time: UNPACKED, the words unpacked into one tile in order and one ``tl.dot`` (quant_matmul.py's GEMM);
    else one ``tl.dot`` per element position of the words. HAS_PERM: the expert's planes hold its inputs in another
    order (GPTQ act-order, sorted by group): input k of the planes is column ``perm[expert, k]`` of a."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_LOCAL:
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_ok = pairs < P
    rows = (pairs // TOP_K if ROWS_BY_TOKEN else pairs).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    e = expert.to(tl.int64)
    low_ptr += e * stride_low
    high_ptr += e * stride_high
    d_ptr += e * stride_d
    m_ptr += e * stride_m
    fa_ptr += e * stride_fa
    fb_ptr += e * stride_fb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for w0 in range(0, K // PER_WORD, BLOCK_W):
        words = w0 + tl.arange(0, BLOCK_W)
        word_ok = words < K // PER_WORD
        first, low, high, scale, offset = tile(low_ptr, high_ptr, d_ptr, m_ptr, fa_ptr, fb_ptr, words, word_ok, cols,
                                                col_ok, N, LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE,
                                                B_MODE, B_CONST, HAS_M)
        if UNPACKED:
            inputs = w0 * PER_WORD + tl.arange(0, BLOCK_W * PER_WORD)
            k_ok = inputs < K
            if HAS_PERM:
                inputs = tl.load(perm_ptr + e * K + inputs, mask=k_ok, other=0)
            x = tl.load(a_ptr + rows[:, None] * stride_am + inputs[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                        other=0.0)
            acc = dot_unpacked(x, low, high, first, scale, offset, acc, LOW_BITS, HIGH_BITS, FLOAT8, IEEE, UPCAST)
        else:
            for S in tl.static_range(PER_WORD):
                inputs = words * PER_WORD + S
                if HAS_PERM:
                    inputs = tl.load(perm_ptr + e * K + inputs, mask=word_ok, other=0)
                x = tl.load(a_ptr + rows[:, None] * stride_am + inputs[None, :],
                            mask=pair_ok[:, None] & word_ok[None, :], other=0.0)
                w = (quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset).to(x.dtype)
                acc = dot_into(x, w, acc, IEEE, UPCAST)
    out = acc.to(out_ptr.dtype.element_ty)
    if SCALE_ROWS:   # as the torch path: the expert's output and the weight in the activations' dtype
        out = out * tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(out_ptr.dtype.element_ty)[:, None]
    tl.store(out_ptr + pairs.to(tl.int64)[:, None] * stride_om + col_offset + cols[None, :], out,
             mask=pair_ok[:, None] & col_ok[None, :])


def _gemm(a: torch.Tensor, weight: QuantWeight, out: torch.Tensor, col_offset: int, sorted_pairs: torch.Tensor,
          block_expert: torch.Tensor, weights: torch.Tensor, top_k: int, rows_by_token: bool, block_m: int,
          perm: torch.Tensor | None = None) -> None:
    run_or_fall_back(("moe", weight.layout, block_m),
                     lambda: _launch(a, weight, out, col_offset, sorted_pairs, block_expert, weights, top_k,
                                     rows_by_token, block_m, perm, unpacked=True),
                     lambda: _launch(a, weight, out, col_offset, sorted_pairs, block_expert, weights, top_k,
                                     rows_by_token, block_m, perm, unpacked=False))


def _launch(a: torch.Tensor, weight: QuantWeight, out: torch.Tensor, col_offset: int, sorted_pairs: torch.Tensor,
            block_expert: torch.Tensor, weights: torch.Tensor, top_k: int, rows_by_token: bool, block_m: int,
            perm: torch.Tensor | None, unpacked: bool) -> None:
    low = weight.low
    tensors = [getattr(weight, name) if getattr(weight, name) is not None else low for name in _PLANES]
    strides = [t.stride(0) if getattr(weight, name) is not None else 0 for name, t in zip(_PLANES, tensors)]
    # unpacked: a K step of 64 inputs at every plane width (as quant_matmul.GEMM_CONFIGS); per position: 16 words
    block_n, block_w = 64, (2 * weight.layout.low_bits if unpacked else 16)
    grid = (block_expert.shape[0], triton.cdiv(weight.out_features, block_n))
    _moe_planes_gemm[grid](a, out, sorted_pairs, block_expert, weights, low if perm is None else perm, *tensors,
                           *strides, weight.out_features,
                           weight.in_features, out.shape[0], a.stride(0), out.stride(0), col_offset,
                           **weight.layout.kernel_args(), NUM_LOCAL=low.shape[0], TOP_K=top_k,
                           ROWS_BY_TOKEN=rows_by_token, SCALE_ROWS=not rows_by_token, BLOCK_M=block_m,
                           BLOCK_N=block_n, BLOCK_W=block_w, IEEE=a.dtype == torch.float32, UPCAST=upcast(a.dtype),
                           HAS_PERM=perm is not None, UNPACKED=unpacked, num_warps=4, num_stages=2,
                           **pdl.options(a.device))


def fused_moe_planes(hidden: torch.Tensor, gate_up: list[QuantWeight], down: QuantWeight, topk_weights: torch.Tensor,
                     local_ids: torch.Tensor, silu_and_mul, perms: list[torch.Tensor | None] | None = None
                     ) -> torch.Tensor:
    """``fused_moe`` with stacked low-bit experts: ``gate_up`` the parts of each expert's [2I, H] rows in order
    (one part, or gate then up), ``down`` [H, I]; ids local to this rank (E: another rank's expert). ``perms``:
    per part (gate_up's, then down), None or int32 [E, K]: the order of the inputs each expert's planes hold.
    Decode steps of up to PAIR_GEMV_MAX pairs take moe_planes_gemv.py's two expert GEMVs (silu fused there;
    CVLLM_MOE_PLANES_GEMV=0: never)."""
    tokens, top_k = local_ids.shape
    num_local = down.low.shape[0]
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if tokens * top_k <= PAIR_GEMV_MAX and len(gate_up) <= 2:
        return moe_planes_gemv(hidden, gate_up, down, topk_weights, local_ids, perms)
    pairs = tokens * top_k
    sorted_pairs, block_expert, block_m = pair_layout(local_ids, num_local)
    weights = topk_weights.reshape(-1).float()
    width = sum(part.out_features for part in gate_up)
    rows = torch.empty((pairs, width), dtype=hidden.dtype, device=hidden.device)
    perms = perms or [None] * (len(gate_up) + 1)
    offset = 0
    for part, perm in zip(gate_up, perms):
        _gemm(hidden, part, rows, offset, sorted_pairs, block_expert, weights, top_k, True, block_m, perm)
        offset += part.out_features
    inner = silu_and_mul(rows)
    out = torch.zeros((pairs, down.out_features), dtype=hidden.dtype, device=hidden.device)
    _gemm(inner, down, out, 0, sorted_pairs, block_expert, weights, top_k, False, block_m, perms[-1])
    return out.view(tokens, top_k, -1).sum(dim=1)
