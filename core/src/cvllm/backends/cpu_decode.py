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


def gather_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, keys: DecodeKeys, batch: int,
                buffers: GatherBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``keys.blocks`` gathered: [batch, gathered positions, Hkv, D], rows past an end zeroed."""
    _, block_size, Hkv, D = k_cache.shape
    Dv = v_cache.shape[3]
    n = batch * keys.num_blocks
    k, v = buffers.take(k_cache.dtype, (n, block_size, Hkv, D), (n, block_size, Hkv, Dv))
    torch.index_select(k_cache, 0, keys.blocks, out=k)
    torch.index_select(v_cache, 0, keys.blocks, out=v)
    if keys.past_end is not None:
        k.view(-1, Hkv, D).index_fill_(0, keys.past_end, 0.0)
        v.view(-1, Hkv, Dv).index_fill_(0, keys.past_end, 0.0)
    return k.view(batch, -1, Hkv, D), v.view(batch, -1, Hkv, Dv)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q [B, H, D] over gathered k, v [B, S, Hkv, D]: [B, H, Dv]."""
    B, H, _ = q.shape
    # [B, Hkv, S, D] views of the gathered [B, S, Hkv, D]: the kernel takes strided keys and values, no copy
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if k.dtype != q.dtype:
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=H != k.shape[1])   # [B, H, 1, Dv]
    return out.reshape(B, H, v.shape[3])


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, keys: DecodeKeys, scale: float,
                     buffers: GatherBuffers) -> torch.Tensor:
    """q: [B, H, D], each row's query at its sequence's last position; the caches: [blocks, block_size, Hkv, D].
    Returns [B, H, Dv] in q's dtype."""
    k, v = gather_keys(k_cache, v_cache, keys, q.shape[0], buffers)
    return _attend(q, k[:, keys.start:keys.stop], v[:, keys.start:keys.stop], keys.mask, scale)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                    seq_len: int, block_size: int, window: int | None, scale: float,
                    buffers: GatherBuffers) -> torch.Tensor:
    """The queries of one sequence's short chunk (a speculative verify step's last token and drafts), q [n, H, D] at
    its last n positions, each attended to as a decode step at that position attends: over a slice of its keys,
    no mask (one gather for the chunk, one SDPA call a row). Bit for bit a decode step's arithmetic, so that a
    verified token is the one plain decoding produces (the prefill path sums in another order, and a masked span
    of the batched decode path rounds differently too). ``table``: [1, >= blocks] the sequence's block table."""
    n = q.shape[0]
    lens = range(seq_len - n + 1, seq_len + 1)
    lows = [max(0, length - window) if window else 0 for length in lens]
    keys = DecodeKeys.build(table, [seq_len], block_size, None if window is None else window + n - 1)
    offset = lows[0] - keys.start   # the position of the first gathered key
    k, v = gather_keys(k_cache, v_cache, keys, 1, buffers)
    out = torch.empty_like(q)
    for j, (low, length) in enumerate(zip(lows, lens)):   # (at most DECODE_CHUNK rows)
        out[j:j + 1] = _attend(q[j:j + 1], k[:, low - offset:length - offset], v[:, low - offset:length - offset],
                               None, scale)
    return out
