"""Store one step's keys and values in the paged KV cache: one Triton launch for both K and V.

Cache layout (the engine's): ``[num_blocks, block_size, Hkv, D]`` per layer, and a token's slot is
``block * block_size + offset``; an FP8 value cache holds that tensor laid out by key in memory
(``empty_value_cache``), which the kernels read through its strides. Slot -1 marks a token whose K/V
is not stored (padding rows of a CUDA graph), so the kernel tests the slot on the device instead of the
host filtering the batch: no host sync, and the launch is graph-capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

# Elements one program copies per tensor: enough work to hide a launch's index arithmetic,
# small enough that a big batch still spreads over every SM.
_ELEMENTS_PER_PROGRAM = 2048


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    num_kv_heads, block_size,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding: nothing to store
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    # BLOCK_D is HEAD_DIM rounded up to a power of two (tl.arange needs one): mask the tail (D = 80, 96)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    row = token.to(tl.int64)

    k = tl.load(k_ptr + row * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    if FP8:   # x / its head's scale, saturated to e4m3's range (cvllm/layers/kv_fp8.py)
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        k = tl.clamp(k.to(tl.float32) / k_scale[:, None], -448.0, 448.0)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads[:, None] * stride_kch + dims[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

    v = tl.load(v_ptr + row * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8:
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        v = tl.clamp(v.to(tl.float32) / v_scale[:, None], -448.0, 448.0)
    v_dst = (v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch
             + dims[None, :] * stride_vcd)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` ``[T]`` (slots < 0 skipped). FP8
    caches take ``scales`` (K's and V's, float32 [Hkv]): ``x / scale`` saturated to ±448 is stored.

    ``k`` and ``v`` may be strided views (a slice of a fused QKV output) as long as their last dim is
    contiguous; the K cache needs a contiguous last dim too, the V cache that or its keys by page
    (``empty_value_cache``). Values are cast to the cache dtype.
    The grid depends on T and Hkv only.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,), (k.shape, v.shape, slot_mapping.shape)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.shape == k_cache.shape, k_cache.shape
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache)):
        assert t.stride(-1) == 1, f"{name} needs a contiguous last dim"
    assert not slot_mapping.is_floating_point() and slot_mapping.stride(0) == 1
    if num_tokens == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_kv_heads), max(1, _ELEMENTS_PER_PROGRAM // block_d))
    grid = (num_tokens, cdiv(num_kv_heads, block_h))
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert fp8 == (scales is not None), "an FP8 cache needs its scales (and only an FP8 cache)"
    k_scale, v_scale = scales if fp8 else (slot_mapping, slot_mapping)   # unused pointers otherwise
    _write_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        num_kv_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *v_cache.stride(),
        HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8, **pdl.options(k.device),
    )


def empty_value_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised V cache of logical shape ``[num_blocks, block_size, Hkv, D]``. An FP8 one lies in memory as
    ``[num_blocks, Hkv, D, block_size]`` (vLLM's V layout): a page's keys contiguous for each dimension, as the
    attention's P @ V needs its 8-bit operand (contiguous along the reduction; attention_step.py). 16-bit caches
    stay contiguous (``ldmatrix.trans`` turns them)."""
    if dtype != torch.float8_e4m3fn or len(shape) != 4:
        return torch.empty(shape, dtype=dtype, device=device)
    blocks, block_size, heads, dim = shape
    return torch.empty((blocks, heads, dim, block_size), dtype=dtype, device=device).permute(0, 3, 1, 2)
