"""Neox-style rotary embedding of q and k in one Triton launch, cos/sin gathered by position in the kernel.

``cos_sin`` is the table ``RotaryEmbedding`` keeps on the device in the activations' dtype:
``[max_position, rotary_dim]`` = cos ‖ sin halves. Each output element is computed with the roundings
of the torch code (``x * cos + rotate_half(x) * sin`` in the dtype): both products rounded to the
dtype, then their sum rounded, so the results are those of the torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

_TILE_ELEMENTS = 2048  # (heads x half rotary dims) per program


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, cos, sin, token, first_head, num_heads, stride_t, stride_h,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    heads = first_head + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
    src = x_ptr + token.to(tl.int64) * stride_t + heads[:, None] * stride_h + dims[None, :]
    dst = out_ptr + (token.to(tl.int64) * num_heads + heads[:, None]) * HEAD_DIM + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # products of two dtype values are exact in fp32; rounding each to the dtype, then the sum,
    # reproduces torch's (x * cos) + (rotate_half(x) * sin) with rotate_half's sign on sin
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    tl.store(dst, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2_cos + x1_sin).to(dtype), mask=mask)
    if BLOCK_TAIL > 0:  # partial rotary: the features past rotary_dim pass through
        tail = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tail_mask = (heads < num_heads)[:, None] & (tail < HEAD_DIM)[None, :]
        src_tail = x_ptr + token.to(tl.int64) * stride_t + heads[:, None] * stride_h + tail[None, :]
        dst_tail = out_ptr + (token.to(tl.int64) * num_heads + heads[:, None]) * HEAD_DIM + tail[None, :]
        tl.store(dst_tail, tl.load(src_tail, mask=tail_mask), mask=tail_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, cos_sin_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    # grid: (token, head block); the head blocks of q come first, then those of k
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + position * stride_table
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if head_block < q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, cos, sin, token, head_block * BLOCK_H, num_q_heads, stride_qt, stride_qh,
                      HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, BLOCK_TAIL)
    else:
        _rotate_heads(k_ptr, k_out_ptr, cos, sin, token, (head_block - q_blocks) * BLOCK_H, num_k_heads,
                      stride_kt, stride_kh, HEAD_DIM, HALF, BLOCK_H, BLOCK_HALF, BLOCK_TAIL)


def _heads_view(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x`` [T, ...] as [T, heads, head_dim] with a contiguous last dim (a view of a fused qkv slice)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(x.shape[0], -1, head_dim)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_sin: torch.Tensor,
           head_dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate every head of ``q`` and ``k`` (``[T, ...]``, ``head_dim`` features a head; ``k`` may be None)
    by the angles of ``positions`` [T]: the first ``cos_sin.shape[1]`` features of each head, neox style.

    ``q`` and ``k`` may be strided views (columns of a fused qkv output); the results are new contiguous
    tensors shaped like the inputs, in their dtype (``cos_sin`` is expected in that dtype too).
    """
    rotary_dim = cos_sin.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, (rotary_dim, head_dim)
    assert positions.shape == (q.shape[0],) and cos_sin.stride(-1) == 1, (positions.shape, q.shape)
    positions = positions.contiguous()
    q3 = _heads_view(q, head_dim)
    k3 = _heads_view(k, head_dim) if k is not None else q3[:, :0]
    assert k3.shape[0] == q3.shape[0] and k3.dtype == q3.dtype, (k3.shape, k3.dtype, q3.dtype)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k is not None else None
    num_tokens, num_q_heads, num_k_heads = q3.shape[0], q3.shape[1], k3.shape[1]
    if num_tokens == 0:
        return q_out, k_out
    half = rotary_dim // 2
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(max(num_q_heads, num_k_heads)), max(1, _TILE_ELEMENTS // block_half))
    tail = head_dim - rotary_dim
    grid = (num_tokens, cdiv(num_q_heads, block_h) + cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        positions, cos_sin, q3, k3, q_out, k_out if k_out is not None else q_out,
        num_q_heads, num_k_heads, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), cos_sin.stride(0),
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_TAIL=next_power_of_2(tail),  # 0 when the whole head rotates
        num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: the products round as torch's do
        **pdl.options(q.device),
    )
    return q_out, k_out
