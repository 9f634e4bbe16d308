"""The Backend interface: what the engine needs from a device, and nothing more."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class Backend:
    name: str = "base"
    device: torch.device = torch.device("cpu")
    dist_backend: str = "gloo"          # torch.distributed backend for tensor parallelism
    default_dtype: torch.dtype = torch.float32

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

    def synchronize(self) -> None:
        pass
