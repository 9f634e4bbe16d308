"""The Backend interface: what the engine needs from a device, and nothing more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cvllm.forward_context import current_forward_context


class Backend:
    name: str = "base"
    device: torch.device = torch.device("cpu")
    dist_backend: str = "gloo"          # torch.distributed backend for tensor parallelism
    default_dtype: torch.dtype = torch.float32
    # torch CPU threads for the engine's process once the model is loaded (None: leave torch's default). A device
    # backend's host work is many small tensor ops each step: a pool of threads adds wake-ups to the larger ones
    # and spins between steps on cores the server and its clients need (OMP_NUM_THREADS, when set, wins)
    host_threads: int | None = None
    # Decode-only forward passes read nothing back to the host: the backend captures them in graphs (CUDA) or
    # queues the next step behind them. Layers whose plain form syncs (MoE's per-expert counts) take a sync-free
    # form on such a backend.
    sync_free_decode: bool = False

    # Optional fused kernels. The layers call one when the backend of the forward pass in progress
    # has it (not None) and run their torch code otherwise, so model code never changes; a fused
    # kernel must return the numbers of that torch code (same roundings) in new tensors. Set plain
    # functions on the instance (or as staticmethods): a function class attribute would bind ``self``.
    #   fused_add_rms_norm(x, residual, weight, eps): RMSNorm.forward (layers/layernorm.py); residual
    #       may be None: ``weight * rms_norm(x)``, else ``(weight * rms_norm(x + residual), x + residual)``
    #   rotary(positions, q, k, cos_sin, head_dim) -> (q, k): RotaryEmbedding's neox rotation of every
    #       head of q [T, ...] and k (or None) by the rows ``positions`` of the table cos_sin
    #       [max_position, rotary_dim] (cos ‖ sin, in the activations' dtype)
    #   rotary_write_kv(positions, q, k, v, cos_sin, head_dim, k_cache, v_cache, slot_mapping) -> q: the
    #       Attention layer's rotary(positions, q, k) then write_kv(k, v, ...) with the rotated k; returns the
    #       rotated q (layers/attention.py)
    #   silu_and_mul(x [..., 2I]) -> [..., I]: SiluAndMul (layers/activation.py)
    #   linear(x, weight, bias): ``F.linear`` of an unquantized linear layer and of the LM head
    #       (layers/quantization.dense), for a backend with its own matmul for some shapes (CUDA: Triton GEMVs)
    #   argmax(x [B, V]) -> int64 [B]: ``x.argmax(dim=-1)`` (first index of the max; NaN ranks highest), for
    #       the sampler (the engine hands it over; no forward pass is in progress when it samples)
    argmax: Callable | None = None
    fused_add_rms_norm: Callable | None = None
    linear: Callable | None = None
    rotary: Callable | None = None
    rotary_write_kv: Callable | None = None
    silu_and_mul: Callable | None = None

    @classmethod
    def is_available(cls) -> bool:
        """Cheap check, called while choosing a backend."""
        raise NotImplementedError

    def memory(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache would come from."""
        raise NotImplementedError

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store this step's K/V ``[T, Hkv, D]`` at ``slot_mapping`` (block * block_size + offset)."""
        raise NotImplementedError

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Any,
                  layer: Any) -> torch.Tensor:
        """Varlen queries ``[T, H, D]`` over the paged cache; prefill chunks and decodes in one call."""
        raise NotImplementedError

    def wrap_decode(self, forward: Callable, max_num_seqs: int, max_blocks_per_seq: int) -> Callable:
        """Optionally wrap the decode-only forward ``forward(input_ids, positions, ctx) -> hidden`` (CUDA
        graphs of up to ``max_num_seqs`` rows); the identity by default. A wrapper with a ``capture_all()``
        method gets it called once, after the KV cache exists."""
        return forward

    def start_readback(self, tensors: list[torch.Tensor]) -> Callable[[], list[torch.Tensor]]:
        """Start copying a step's results (sampled ids, logprobs) to the host; the returned function waits
        for them and returns CPU tensors. A device backend must not make the wait include work queued after
        this call (the next step, under async scheduling): a plain ``.cpu()`` waits for the whole stream."""
        return lambda: [t.cpu() for t in tensors]

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        """Return memory that freed tensors left in the framework's cache to the device (after a shutdown)."""


def fused_kernel(name: str) -> Callable | None:
    """The fused kernel ``name`` of the backend running the current forward pass, or None (no such
    kernel, or no forward pass in progress: a layer called on its own runs its torch code)."""
    ctx = current_forward_context()
    return None if ctx is None else getattr(ctx.backend, name, None)
