"""The metal backend: the engine's device operations on an Apple silicon GPU, through torch's MPS device.

Plain torch ops (paged_attention.py lists the MPS coverage they rely on), no graphs, no tensor parallelism (one GPU
per Mac). The code is device-agnostic: ``CVLLM_METAL_ON_CPU=1`` or ``MetalBackend(device="cpu")`` runs it unchanged
on CPU tensors, which is how CI checks it against the CPU reference backend; only the MPS device itself is untested
there (docs/metal.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from cvllm.backends.base import Backend
from cvllm.backends.cpu import KV_CACHE_BYTES
from cvllm.forward_context import ForwardContext
from cvllm.layers import kv_fp8
from cvllm_metal.device import (
    bf16_supported,
    host_memory,
    mps_available,
    mps_memory,
    on_cpu_requested,
    resolve_device,
)
from cvllm_metal.paged_attention import WORK_BYTES, AttentionPlan, attend

logger = logging.getLogger(__name__)


class MetalBackend(Backend):
    name = "metal"
    priority = 50    # over the CPU backend (0) wherever MPS is there; below CUDA (100), which a Mac never has
    dist_backend = "gloo"
    default_dtype = torch.bfloat16   # float16 before macOS 14 (set per instance: bf16_supported)
    # unmeasured on a Mac: the CPU backend's numbers, the attention here being the same gather-and-matmul shape
    default_max_num_seqs = 16
    default_max_num_batched_tokens = 2048
    # the sampled ids are read back with a plain .cpu(), which waits for everything queued: a step launched before
    # it would be waited for too, so async scheduling would overlap nothing
    default_async_scheduling = False

    @classmethod
    def is_available(cls) -> bool:
        return on_cpu_requested() or mps_available()

    @classmethod
    def bind_device(cls, index: int) -> None:
        if index != 0:
            raise ValueError(f"the metal backend has one device (the Mac's GPU, --d 0), not device {index}; "
                             f"tensor parallelism over several GPUs is CUDA's")

    def __init__(self, device: str | torch.device | None = None, work_bytes: int = WORK_BYTES) -> None:
        """``device``: None for MPS (the CPU under ``CVLLM_METAL_ON_CPU=1``); "cpu" runs this backend on CPU tensors.
        ``work_bytes``: the float32 bytes one piece of attention work may hold (paged_attention.py)."""
        self.device = resolve_device(device)
        self.work_bytes = work_bytes
        self.default_dtype = torch.bfloat16 if bf16_supported(self.device) else torch.float16
        # every layer of a forward pass writes through the same slot mapping: look for padding once
        self._slots_seen: torch.Tensor | None = None
        self._slots_kept: torch.Tensor | None = None
        if self.device.type == "mps":
            _log_limits(self.default_dtype)

    def memory(self) -> tuple[int, int]:
        return mps_memory() if self.device.type == "mps" else host_memory()

    def default_kv_cache_bytes(self, free: int) -> int:
        """Half of what is free on MPS: macOS, the server's host side and the user's other applications live in the
        same memory, and Metal's working-set figure is advice, not a reservation. On the CPU, the CPU backend's
        rule."""
        if self.device.type != "mps":
            return min(KV_CACHE_BYTES, free // 2)
        return free // 2

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, scales=None) -> None:
        if scales is not None or kv_fp8.is_fp8(k_cache):
            raise _no_fp8()
        if slot_mapping is not self._slots_seen:
            # one read of the device per forward pass (every layer shares the tensor): -1 marks a token whose K/V is
            # not stored; nothing in core makes one today, but the contract allows it
            self._slots_seen = slot_mapping
            padded = slot_mapping.numel() and int(slot_mapping.min()) < 0
            self._slots_kept = (slot_mapping >= 0) if padded else None
        if self._slots_kept is not None:
            keep = self._slots_kept
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        # index_put_ (accumulate=False), a native MPS kernel; slots are distinct, so the order of writes is moot
        k_cache.view(-1, *k_cache.shape[2:]).index_put_((slot_mapping,), k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_put_((slot_mapping,), v.to(v_cache.dtype))

    def prepare(self, ctx: ForwardContext) -> None:
        ctx.backend_data = AttentionPlan.build(ctx)   # the same for every layer: worked out once per forward pass

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Any,
                  layer: Any) -> torch.Tensor:
        plan = ctx.backend_data
        assert isinstance(plan, AttentionPlan), "the forward pass's ctx was not prepared (Backend.prepare)"
        if kv_fp8.is_fp8(k_cache):
            raise _no_fp8()
        args = (layer.scale, layer.sliding_window, layer.logits_soft_cap, self.work_bytes)
        outs = [(part.rows, attend(plan.queries(q, part), k_cache, v_cache, part, *args).view(-1, *q.shape[1:]))
                for part in plan.parts]
        if plan.whole_batch:   # a decode-only step, or one sequence's prefill: nothing to scatter
            return outs[0][1]
        out = torch.empty_like(q)
        for rows, o in outs:
            if isinstance(rows, slice):
                out[rows] = o
            else:   # the decode rows, wherever they are in the batch: index_put_, a native MPS kernel
                out.index_put_((rows,), o)
        return out

    def synchronize(self) -> None:
        if self.device.type == "mps":
            torch.mps.synchronize()

    def record_event(self) -> Any:
        if self.device.type != "mps":
            return None
        event = torch.mps.event.Event(enable_timing=True)
        event.record()
        return event

    def empty_cache(self) -> None:
        if self.device.type == "mps":
            torch.mps.empty_cache()


def _no_fp8() -> NotImplementedError:
    return NotImplementedError("the metal backend has no FP8 KV cache (MPS has no float8 type): "
                               "use --kv-cache-dtype auto")


_logged: list[bool] = []


def _log_limits(dtype: torch.dtype) -> None:
    """Once per process, what this backend does not do on MPS, so a user sees why before it matters."""
    if _logged:
        return
    _logged.append(True)
    if dtype != torch.bfloat16:
        logger.warning("metal: bfloat16 needs macOS 14 on MPS; serve a bf16 checkpoint with --dtype float16")
    # The quantization plugins pick their compute form by device type (a packed int4 matmul on the CPU, Triton
    # kernels on CUDA); on MPS they take their generic path, and no MPS int4 path was measured (docs/metal.md)
    logger.warning("metal: quantized checkpoints (GGUF, GPTQ/AWQ, FP8) are dequantized at load on MPS "
                   "(16-bit weights: about 4x the memory of Q4 blocks); no packed int4 matmul is used on MPS")
