"""Paged attention layer: writes this step's K/V into the cache and attends over it.

The kernels belong to the backend (CPU reference, Triton on CUDA); the layer only carries the
per-layer parameters (scale, GQA, sliding window, soft-cap) and its slice of the KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from cvllm.forward_context import get_forward_context
from cvllm.layers import kv_fp8
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    # the linear layer the model hands this attention's output to (layers/decoder.feed; RMSNorm.feeds says why)
    feeds: nn.Module | None = None

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None, shared_kv: bool = False,
                 value_dim: int | None = None):
        """``shared_kv``: V is K (MLA's latent: one cache tensor, ``v_cache is k_cache``, half the bytes);
        ``value_dim``: the output's features per head, the first ``value_dim`` of the values (MLA: the latent
        without its rope part), all ``head_dim`` by default."""
        super().__init__()
        self.shared_kv = shared_kv
        self.value_dim = value_dim or head_dim
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window  # position i attends j when i - j < window (HF's rule)
        self.logits_soft_cap = logits_soft_cap
        # Set by the ModelRunner once the KV pool is allocated: [num_blocks, block_size, kv_heads, head_dim]
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # an FP8 cache's scales (float32 [1] each, layers/kv_fp8.py), also set by the ModelRunner
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None

    def kv_cache_shape(self) -> tuple[int, ...]:
        """Per-token shape of one of this layer's K and V caches."""
        return (self.num_kv_heads, self.head_dim)

    def kv_cache_tensors(self) -> int:
        """How many cache tensors of ``kv_cache_shape`` the layer has: K and V, or one shared (``shared_kv``)."""
        return 1 if self.shared_kv else 2

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor | None = None,
                rotary_emb: RotaryEmbedding | None = None,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
        """Attention of this step's tokens; with ``rotary_emb``, q and k are rotated by ``positions`` first
        (here, so that a backend can rotate the keys on their way into the cache: one kernel, not two).
        ``qk_norm``: RMSNorms over each head of q and of k before the rotation (Qwen3), fused into the same
        kernel where the backend can."""
        ctx = get_forward_context()
        fp8 = kv_fp8.is_fp8(self.k_cache)
        scales = (self.k_scale, self.v_scale) if fp8 else None
        fused = ctx.backend.rotary_write_kv if rotary_emb is not None else None
        calibrating = fp8 and self.kv_scales_pending and not ctx.is_decode_only and not ctx.capturing
        norm_fused = (qk_norm is not None and fused is not None and not calibrating
                      and all(norm._fusable and norm._fused_kernel == "fused_add_rms_norm" for norm in qk_norm)
                      and rotary_emb.rotary_dim == self.head_dim)   # (the rotary kernel's norm is the plain one)
        if qk_norm is not None and not norm_fused:
            q_norm, k_norm = qk_norm
            q = q_norm(q.reshape(-1, self.num_heads, self.head_dim)).reshape(q.shape)
            k = k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim)).reshape(k.shape)
        if calibrating:
            kv_fp8.calibrate(self, k, v)   # the first prefill this layer sees sets its scales (kv_fp8.py)
        if fused is not None:
            extra = {"scales": scales} if fp8 else {}
            if getattr(rotary_emb, "interleaved", False):   # GPT-J pairs (GLM4): the kernel's other pairing
                extra["interleaved"] = True
            if norm_fused:
                q_norm, k_norm = qk_norm
                extra["qk_norm"] = (q_norm.weight, k_norm.weight, q_norm.eps)
            q = fused(positions, q, k, v, rotary_emb.cos_sin_for(positions, q), self.head_dim,
                      self.k_cache, self.v_cache, ctx.slot_mapping, **extra)
        else:
            if rotary_emb is not None:
                q, k = rotary_emb(positions, q, k)
            k = k.view(-1, self.num_kv_heads, self.head_dim)   # [T, Hkv, D]
            v = v.view(-1, self.num_kv_heads, self.head_dim)
            if fp8:
                ctx.backend.write_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, scales=scales)
            else:
                ctx.backend.write_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping)
        out = ctx.backend.attention(q.view(-1, self.num_heads, self.head_dim), self.k_cache, self.v_cache, ctx, self)
        if out.shape[-1] != self.value_dim:   # a backend may return every feature of the values, or value_dim
            out = out[..., : self.value_dim]
        return out.reshape(-1, self.num_heads * self.value_dim)
