"""The CPU backend's decode attention: one query per sequence over its paged K/V through torch's fused
``scaled_dot_product_attention`` (on the CPU its flash kernel: one pass over the keys and values in the cache's
dtype, float32 accumulation), the blocks gathered once into buffers kept between layers and steps.

``paged_attention_reference`` (cpu.py) computes the same in float32 with explicit masks, a few passes over an fp32
copy of the keys and values: it stays the oracle, and serves what this path does not (prefill chunks, soft-capped
logits, FP8 caches)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class GatherBuffers:
    """Where the decode rows' K/V are gathered, reused by every layer and step: a fresh tensor of this size per
    layer (MBs at long context) is mmapped and page-faulted anew on every call."""

    def __init__(self) -> None:
        self._flat: dict[torch.dtype, torch.Tensor] = {}

    def take(self, dtype: torch.dtype, k_shape: tuple[int, ...],
             v_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        nk, nv = math.prod(k_shape), math.prod(v_shape)
        flat = self._flat.get(dtype)
        if flat is None or flat.numel() < nk + nv:
            flat = self._flat[dtype] = torch.empty(nk + nv, dtype=dtype)
        return flat[:nk].view(k_shape), flat[nk:nk + nv].view(v_shape)


@dataclass(slots=True)
class DecodeKeys:
    """What the decode rows read, worked out once per forward pass (and sliding window): the blocks to gather,
    the span of the gathered keys attended to, and for sequences of unequal length a mask and the gathered rows
    past each one's end, zeroed before use (SDPA adds the mask to q·k and weighs the values by the
    probabilities: garbage there, NaN in a never-zeroed cache, would poison the row)."""
    blocks: torch.Tensor             # [B * num_blocks] int64
    num_blocks: int                  # gathered per sequence
    start: int                       # the span of each sequence's num_blocks * block_size gathered keys
    stop: int
    mask: torch.Tensor | None        # [B, 1, 1, stop - start] bool; None: every sequence sees the whole span
    past_end: torch.Tensor | None    # [n] int64 rows of the gathered [B * num_blocks * block_size] past an end

    @classmethod
    def build(cls, tables: torch.Tensor, lens: list[int], block_size: int, window: int | None) -> DecodeKeys:
        """``tables``: [B, >= max blocks] of the decode rows; ``lens``: their kv lengths (the query is the last)."""
        lows = [max(0, n - window) if window else 0 for n in lens]   # the first key each query sees
        first = min(lows) // block_size          # leading blocks no query sees (a sliding window) are not read
        last = -(-max(lens) // block_size)
        blocks = tables[:, first:last].reshape(-1).long()
        offset = first * block_size
        if len(lens) == 1:   # one sequence: a slice of its keys, no mask
            return cls(blocks, last - first, lows[0] - offset, lens[0] - offset, None, None)
        span = (last - first) * block_size
        j = torch.arange(offset, offset + span)
        past = j >= torch.tensor(lens)[:, None]                                   # [B, span]
        visible = ~past & (j >= torch.tensor(lows)[:, None])
        rows = past.view(-1).nonzero().view(-1)
        return cls(blocks, last - first, 0, span, None if bool(visible.all()) else visible[:, None, None],
                   rows if rows.numel() else None)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: DecodeKeys, scale: float,
                     buffers: GatherBuffers) -> torch.Tensor:
    """q: [B, H, D], each row's query at its sequence's last position; the caches: [blocks, block_size, Hkv, D].
    Returns [B, H, Dv] in q's dtype."""
    B, H, _ = q.shape
    _, block_size, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n = B * keys.num_blocks
    k, v = buffers.take(k_cache.dtype, (n, block_size, Hkv, D), (n, block_size, Hkv, Dv))
    torch.index_select(k_cache, 0, keys.blocks, out=k)
    torch.index_select(v_cache, 0, keys.blocks, out=v)
    if keys.past_end is not None:
        k.view(-1, Hkv, D).index_fill_(0, keys.past_end, 0.0)
        v.view(-1, Hkv, Dv).index_fill_(0, keys.past_end, 0.0)
    # [B, Hkv, S, D] views of the gathered [B, S, Hkv, D]: the kernel takes strided keys and values, no copy
    k = k.view(B, -1, Hkv, D)[:, keys.start:keys.stop].transpose(1, 2)
    v = v.view(B, -1, Hkv, Dv)[:, keys.start:keys.stop].transpose(1, 2)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keys.mask, scale=scale,
                                         enable_gqa=H != Hkv)   # [B, H, 1, Dv]
    return out.reshape(B, H, Dv)
