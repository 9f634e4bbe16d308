"""Neox-style (or GPT-J-style, ``interleaved``) rotary embedding of q and k in one Triton launch, cos/sin gathered
by position in the kernel;
``rotary_write_kv`` also stores the rotated keys and the values in the paged KV cache in that launch.

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
def _to_cache(value, scale, FP8: tl.constexpr):
    """A rounded value as the destination stores it: an FP8 cache holds value / its head's scale, saturated."""
    # (one return: Triton compiles every return of a function, and two of different dtypes do not compile even
    # where a constexpr leaves one unreachable)
    if FP8:
        value = tl.clamp(value.to(tl.float32) / scale[:, None], -448.0, 448.0)
    return value


@triton.jit
def _rotate_heads(
    src_row, src_stride_h, dst_row, dst_stride_h, cos, sin, first_head, num_heads, scale_ptr, norm_ptr, eps,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr, FP8: tl.constexpr = False, INTERLEAVED: tl.constexpr = False, NORM: tl.constexpr = False,
):
    """Rotates heads [first_head, first_head + BLOCK_H) of one token; ``src_row`` and ``dst_row`` point at
    the token's head 0, heads ``*_stride_h`` elements apart. FP8: ``dst_row`` is an FP8 cache and ``scale_ptr``
    its per-head scales. INTERLEAVED: the pairs are features (2i, 2i + 1) (GPT-J, DeepSeek), not (i, i + HALF).
    NORM: each head first goes through RMSNorm with weight ``norm_ptr`` [HEAD_DIM] (Qwen3's q_norm / k_norm; the
    whole head rotates), rounded as RMSNorm's torch code and the fused norm kernel (rms_norm.py) round it."""
    heads = first_head + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
    if INTERLEAVED:
        first, second = dims * 2, dims * 2 + 1
    else:
        first, second = dims, dims + HALF
    src = src_row + heads[:, None] * src_stride_h
    dst = dst_row + heads[:, None] * dst_stride_h
    dtype = src_row.dtype.element_ty        # torch's roundings happen in the activations' dtype,
    out_dtype = dst_row.dtype.element_ty    # then the value is stored in the destination's (a KV cache's)
    x1 = tl.load(src + first[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second[None, :], mask=mask, other=0.0).to(tl.float32)
    if NORM:   # F.rms_norm in fp32 (IEEE division and square root), rounded; times the weight, rounded
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, HEAD_DIM, tl.float32))
        rstd = tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.math.sqrt_rn(mean_sq + eps))[:, None]
        w1 = tl.load(norm_ptr + first, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + second, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # products of two dtype values are exact in fp32; rounding each to the dtype, then the sum,
    # reproduces torch's (x * cos) + (rotate_half(x) * sin) with rotate_half's sign on sin
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    scale = tl.load(scale_ptr + heads, mask=heads < num_heads, other=1.0) if FP8 else cos
    tl.store(dst + first[None, :], _to_cache((x1_cos - x2_sin).to(dtype), scale, FP8).to(out_dtype), mask=mask)
    tl.store(dst + second[None, :], _to_cache((x2_cos + x1_sin).to(dtype), scale, FP8).to(out_dtype), mask=mask)
    if BLOCK_TAIL > 0:  # partial rotary: the features past rotary_dim pass through
        tail = 2 * HALF + tl.arange(0, BLOCK_TAIL)
        tail_mask = (heads < num_heads)[:, None] & (tail < HEAD_DIM)[None, :]
        value = tl.load(src_row + heads[:, None] * src_stride_h + tail[None, :], mask=tail_mask)
        tl.store(dst_row + heads[:, None] * dst_stride_h + tail[None, :], _to_cache(value, scale, FP8).to(out_dtype),
                 mask=tail_mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, cos_sin_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, slot_ptr, k_scale_ptr,
    v_scale_ptr, q_norm_ptr, k_norm_ptr, eps,
    num_q_heads, num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_table,
    block_size, stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, TO_CACHE: tl.constexpr, FP8: tl.constexpr,
    INTERLEAVED: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    # grid: (token, head block); the head blocks of q come first, then those of k, then (TO_CACHE) v's
    token = tl.program_id(0)
    head_block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    k_blocks = tl.cdiv(num_k_heads, BLOCK_H)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + position * stride_table
    cos = tl.load(row + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    t = token.to(tl.int64)
    if head_block < q_blocks:
        _rotate_heads(q_ptr + t * stride_qt, stride_qh, q_out_ptr + t * num_q_heads * HEAD_DIM, HEAD_DIM, cos, sin,
                      head_block * BLOCK_H, num_q_heads, k_scale_ptr, q_norm_ptr, eps, HEAD_DIM, HALF, BLOCK_H,
                      BLOCK_HALF, BLOCK_TAIL, False, INTERLEAVED, NORM)
    else:
        if TO_CACHE:  # k and v go to the token's slot of the paged caches [blocks, block_size, Hkv, D]
            slot = tl.load(slot_ptr + token).to(tl.int64)
            stored_heads = tl.where(slot >= 0, num_k_heads, 0)   # slot -1 (padding): every lane masked off
            slot = tl.maximum(slot, 0)
            out_row = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
            out_stride_h = stride_ch
            v_row = (slot // block_size) * stride_vcb + (slot % block_size) * stride_vcs
        else:
            stored_heads = num_k_heads
            out_row = t * num_k_heads * HEAD_DIM
            out_stride_h = HEAD_DIM
        if head_block < q_blocks + k_blocks:
            _rotate_heads(k_ptr + t * stride_kt, stride_kh, k_out_ptr + out_row, out_stride_h, cos, sin,
                          (head_block - q_blocks) * BLOCK_H, stored_heads, k_scale_ptr, k_norm_ptr, eps, HEAD_DIM,
                          HALF, BLOCK_H, BLOCK_HALF, BLOCK_TAIL, FP8, INTERLEAVED, NORM)
        elif TO_CACHE:  # v is stored as it is
            heads = (head_block - q_blocks - k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
            d = tl.arange(0, BLOCK_D)
            mask = (heads < stored_heads)[:, None] & (d < HEAD_DIM)[None, :]
            v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
            v_scale = tl.load(v_scale_ptr + heads, mask=heads < stored_heads, other=1.0) if FP8 else v
            tl.store(v_out_ptr + v_row + heads[:, None] * stride_vch + d[None, :] * stride_vcd,
                     _to_cache(v, v_scale, FP8).to(v_out_ptr.dtype.element_ty), mask=mask)


def _heads_view(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``x`` [T, ...] as [T, heads, head_dim] with a contiguous last dim (a view of a fused qkv slice)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(x.shape[0], -1, head_dim)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, cos_sin: torch.Tensor,
           head_dim: int, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate every head of ``q`` and ``k`` (``[T, ...]``, ``head_dim`` features a head; ``k`` may be None)
    by the angles of ``positions`` [T]: the first ``cos_sin.shape[1]`` features of each head, neox style
    (``interleaved``: GPT-J style, features 2i and 2i + 1 a pair).

    ``q`` and ``k`` may be strided views (columns of a fused qkv output); the results are new contiguous
    tensors shaped like the inputs, in their dtype (``cos_sin`` is expected in that dtype too).
    """
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k is not None else None
    return _launch(positions, q, k, None, cos_sin, head_dim, k_out, None, None, interleaved=interleaved), k_out


def rotary_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_sin: torch.Tensor, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    interleaved: bool = False) -> torch.Tensor:
    """``rotary(positions, q, k)`` then ``write_kv(k, v, ..., scales)`` of the rotated k, in one launch: the rotated
    keys go straight to their cache slots (slot -1: nothing stored) and never to a tensor of their own.
    Returns the rotated ``q`` (a new contiguous tensor). Caches: ``[num_blocks, block_size, Hkv, D]``; FP8 caches
    take their per-head ``scales`` (K's, V's) as write_kv does. ``qk_norm`` (q's and k's RMSNorm weights [D], eps):
    each head of q and k normalised first (Qwen3), for a rotary over the whole head. ``interleaved``: GPT-J pairs."""
    assert v.shape == k.shape and v.stride(-1) == 1 and slot_mapping.shape == (q.shape[0],), (v.shape, k.shape)
    assert k_cache.shape[2] * k_cache.shape[3] == k.shape[-1] and k_cache.shape[3] == head_dim, k_cache.shape
    # V laid out like K, or by key (kv_cache.empty_value_cache)
    assert v_cache.shape == k_cache.shape and k_cache.stride(-1) == 1, (v_cache.shape, k_cache.shape)
    assert (k_cache.dtype == torch.float8_e4m3fn) == (scales is not None), "an FP8 cache needs its scales"
    return _launch(positions, q, k, v, cos_sin, head_dim, k_cache, v_cache, slot_mapping.contiguous(), scales,
                   interleaved=interleaved, qk_norm=qk_norm)


def _launch(positions, q, k, v, cos_sin, head_dim, k_out, v_cache, slot_mapping, scales=None,
            interleaved: bool = False, qk_norm=None) -> torch.Tensor:
    """The rotated q; the rotated k goes to ``k_out``: a tensor shaped like k, or (with ``v_cache`` and
    ``slot_mapping``) the paged K cache, v then going to ``v_cache``."""
    rotary_dim = cos_sin.shape[1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, (rotary_dim, head_dim)
    assert qk_norm is None or rotary_dim == head_dim, "the fused q/k norm needs the whole head rotated"
    assert positions.shape == (q.shape[0],) and cos_sin.stride(-1) == 1, (positions.shape, q.shape)
    positions = positions.contiguous()
    q3 = _heads_view(q, head_dim)
    k3 = _heads_view(k, head_dim) if k is not None else q3[:, :0]
    assert k3.shape[0] == q3.shape[0] and k3.dtype == q3.dtype, (k3.shape, k3.dtype, q3.dtype)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_q_heads, num_k_heads = q3.shape[0], q3.shape[1], k3.shape[1]
    if num_tokens == 0:
        return q_out
    to_cache = v_cache is not None
    v3 = _heads_view(v, head_dim) if to_cache else k3
    cache_strides = (*k_out.stride()[:3], *v_cache.stride()) if to_cache else (0,) * 7
    half = rotary_dim // 2
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(max(num_q_heads, num_k_heads)), max(1, _TILE_ELEMENTS // block_half))
    k_blocks = cdiv(num_k_heads, block_h)
    grid = (num_tokens, cdiv(num_q_heads, block_h) + k_blocks * (2 if to_cache else 1))
    _rotary_kernel[grid](
        positions, cos_sin, q3, k3, v3, q_out, k_out if k_out is not None else q_out,
        v_cache if to_cache else q_out, slot_mapping if to_cache else positions, *(scales or (positions, positions)),
        *(qk_norm or (positions, positions, 0.0)),
        num_q_heads, num_k_heads, q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), v3.stride(0),
        v3.stride(1), cos_sin.stride(0), k_out.shape[1] if to_cache else 1, *cache_strides,
        HEAD_DIM=head_dim, HALF=half, BLOCK_H=block_h, BLOCK_HALF=block_half,
        BLOCK_TAIL=next_power_of_2(head_dim - rotary_dim),  # 0 when the whole head rotates
        BLOCK_D=next_power_of_2(head_dim), TO_CACHE=to_cache, FP8=scales is not None, INTERLEAVED=interleaved,
        NORM=qk_norm is not None, num_warps=4,
        enable_fp_fusion=False,  # no FMA contraction: the products round as torch's do
        **pdl.options(q.device),
    )
    return q_out
