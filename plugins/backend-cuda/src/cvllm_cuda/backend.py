"""The CUDA backend: the engine's device operations on an NVIDIA GPU.

Attention, the KV-cache write (the keys rotated on the way in), RMSNorm (also Gemma's 1 + weight one) and LayerNorm
(also per head) with their residual add, rotary, SiLU·up and GELU·up are Triton kernels (kernels/); the matmuls are
cuBLAS's except for one token (a Triton GEMV) and a few where a tuned Triton skinny GEMM beats it (kernels/linear.py).
Decode steps replay CUDA graphs captured per batch size (graphs.py).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

from cvllm.backends.base import Backend, GraphedDecode


class CudaBackend(Backend):
    name = "cuda"
    priority = 100    # over the CPU backend wherever a GPU is there
    dist_backend = "nccl"
    default_dtype = torch.bfloat16
    default_max_num_seqs = 256
    default_max_num_batched_tokens = 8192
    default_async_scheduling = True   # the host schedules step N+1 while the GPU runs step N
    host_threads = 1
    sync_free_decode = True    # decode steps are captured in CUDA graphs
    # a verify step of 4 drafts cost 1.146 decode steps at batch 1 on the H200, Llama-3-8B shape (bench/verify_cost.py)
    draft_token_cost = 0.04
    # n-gram drafts looked up on the device, verify steps launched a step behind (engine/ngram_device.py): on the H200
    # the demo's rewrite task 2.13x plain batch-1 tok/s with them, 1.72x with the host's (docs/benchmarks.md)
    device_drafts = True
    # RMSNorm, silu * up and attention make the int8 activations of the low-bit GEMV they feed (int8_activations.py)
    takes_feeds = True

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()

    @classmethod
    def bind_device(cls, index: int) -> None:
        count = torch.cuda.device_count()
        if not 0 <= index < count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(f"CUDA device {index} does not exist: {count} visible"
                             + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""))
        torch.cuda.set_device(index)

    def __init__(self) -> None:
        from cvllm_cuda.kernels.activation import gelu_and_mul, silu_and_mul
        from cvllm_cuda.kernels.argmax import argmax, argmax_reported
        from cvllm_cuda.kernels.kv_cache import write_kv
        from cvllm_cuda.kernels.lagged_fixup import lagged_fixup
        from cvllm_cuda.kernels.layer_norm import fused_add_layer_norm
        from cvllm_cuda.kernels.linear import linear
        from cvllm_cuda.kernels.ngram import advance_ngram
        from cvllm_cuda.kernels.paged_attention import paged_attention
        from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_plus_one
        from cvllm_cuda.kernels.rotary import rotary, rotary_write_kv

        self.device = torch.device("cuda", torch.cuda.current_device())
        self._write_kv, self._paged_attention = write_kv, paged_attention
        # fused kernels the layers call instead of their torch ops (Backend's attributes say how)
        self.fused_add_rms_norm, self.rotary, self.silu_and_mul = fused_add_rms_norm, rotary, silu_and_mul
        self.fused_add_rms_norm_plus_one, self.fused_add_layer_norm = fused_add_rms_norm_plus_one, fused_add_layer_norm
        self.gelu_and_mul = gelu_and_mul
        # the keys rotated on their way into the cache, one launch a layer instead of two (CVLLM_FUSED_ROPE_KV=0:
        # rotary, then write_kv, for A/B runs)
        self.rotary_write_kv = rotary_write_kv if os.environ.get("CVLLM_FUSED_ROPE_KV", "1") != "0" else None
        # CVLLM_TRITON_MATMUL=0: every matmul through cuBLAS (an A/B switch for benchmarks, and a way out)
        self.linear = linear if os.environ.get("CVLLM_TRITON_MATMUL", "1") != "0" else None
        # the sampler's: torch's one-block-a-row reduction takes ~28 us at a 128k vocabulary; the greedy path's also
        # says which rows are not finite, in the same two launches
        self.argmax, self.argmax_reported = argmax, argmax_reported
        # device drafts (engine/ngram_device.py): a verify step's outcome and the next drafts, and a lagged verify
        # step's inputs, one launch each (~40 and ~13 torch ops otherwise, on the host's critical path)
        self.advance_ngram, self.lagged_fixup = advance_ngram, lagged_fixup
        # MoE layers: the router's choice in one launch and a grouped GEMM over the routed pairs
        # (CVLLM_FUSED_MOE=0: core's torch forms, for A/B runs)
        if os.environ.get("CVLLM_FUSED_MOE", "1") != "0":
            from cvllm_cuda.kernels.fused_moe import fused_moe
            from cvllm_cuda.kernels.moe_routing import route_experts

            self.route_experts = route_experts

            self.fused_moe = functools.partial(fused_moe, silu_and_mul=silu_and_mul)

    def memory(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def empty_kv_cache(self, shape, dtype, device, values) -> torch.Tensor:
        from cvllm_cuda.kernels.kv_cache import empty_value_cache

        # an FP8 V cache by key (the attention's 8-bit operand contiguous along the keys: attention_step.py)
        return empty_value_cache(shape, dtype, device) if values else torch.empty(shape, dtype=dtype, device=device)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, scales=None) -> None:
        self._write_kv(k, v, k_cache, v_cache, slot_mapping, scales)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Any,
                  layer: Any) -> torch.Tensor:
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        if getattr(layer, "shared_kv", False) and layer.value_dim < layer.head_dim:   # MLA (kernels/mla_attention.py)
            from cvllm_cuda.kernels import mla_attention

            latent, rope = layer.value_dim, layer.head_dim - layer.value_dim
            if mla_attention.usable(latent, rope):
                return mla_attention.mla_attention(q, k_cache, latent, ctx.query_start_loc, ctx.seq_lens,
                                                   ctx.block_tables, ctx.max_query_len, layer.scale,
                                                   kv_scales=(layer.k_scale, layer.v_scale) if fp8 else None)
        # the output's int8 form for the output projection's low-bit GEMV (Attention.feeds; kernels/int8_activations)
        feeds = getattr(layer, "feeds", None) if layer.value_dim == layer.head_dim else None
        return self._paged_attention(q, k_cache, v_cache, ctx.query_start_loc, ctx.seq_lens, ctx.block_tables,
                                     ctx.max_query_len, layer.scale, layer.sliding_window, layer.logits_soft_cap,
                                     kv_scales=(layer.k_scale, layer.v_scale) if fp8 else None, feeds=feeds)

    def wrap_decode(self, forward: Callable, max_num_seqs: int, max_blocks_per_seq: int,
                    verify: tuple[int, int] | None = None, chunk_tokens: int = 0) -> GraphedDecode:
        from cvllm_cuda.graphs import DecodeGraphs

        return DecodeGraphs(forward, self, max_num_seqs, max_blocks_per_seq, verify, chunk_tokens)

    def start_readback(self, tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        # into pinned memory without blocking, then wait on an event recorded right after the copies:
        # the wait ends when these copies do, not when the next step (queued behind them) does
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for dst, src in zip(host, tensors):
            dst.copy_(src, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def wait() -> list[torch.Tensor]:
            copied.synchronize()
            return host

        return wait

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def record_event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()
