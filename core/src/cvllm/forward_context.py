"""The forward context: the flat varlen batch description attention layers read.

The runner sets it around each forward pass (nano-vllm's pattern), so model code keeps the
Hugging Face shape ``forward(input_ids, positions)``. A context manager resets it even when
the forward raises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class ForwardContext:
    backend: Any                      # cvllm.backends.base.Backend
    query_start_loc: torch.Tensor     # [B + 1] int32: where each sequence's new tokens start in the flat batch
    seq_lens: torch.Tensor            # [B] int32: tokens in the KV cache after this step (context + new)
    slot_mapping: torch.Tensor        # [T] int64: KV slot of each new token (-1: don't write)
    block_tables: torch.Tensor        # [B, max_blocks] int32, padded with 0
    query_start_loc_cpu: list[int]    # host copies, for backends that split work on the host
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    is_decode_only: bool
    block_size: int = 0               # tokens per KV block (0: not said, for a context that no attention reads)
    backend_data: Any = None          # what Backend.prepare derives from the above, once per forward pass
    # what layers work out once per forward pass and share: rotary cos/sin (layers/rotary.py), MLA's prefill split
    per_step: dict = field(default_factory=dict)
    # a graph's capture (or the run before it) on placeholder inputs: nothing may learn from its values (the first
    # prefill's FP8 KV scales, layers/kv_fp8.py)
    capturing: bool = False


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention ran outside a forward context (the ModelRunner sets one)")
    return _context


def current_forward_context() -> ForwardContext | None:
    """The context of the forward pass running now, or None outside one (a layer called on its own)."""
    return _context


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _context
    previous, _context = _context, ctx
    try:
        yield ctx
    finally:
        _context = previous
