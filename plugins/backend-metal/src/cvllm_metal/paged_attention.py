"""Paged attention on gathered blocks, in torch ops the MPS device runs, device-agnostic (CI runs it on the CPU).

A forward pass's rows split into parts (``AttentionPlan``): every single-token row (decodes) in one padded batch,
and each longer row (a prefill chunk over its cached prefix, a speculative verification) alone, so a long prompt
never pads the decodes. For a part, the blocks of its sequences are gathered into contiguous K/V in float32, and
scores, softmax and the weighted sum are batched matmuls over (sequence, KV head), the GQA query heads of a KV head
being rows of one matmul. Work is cut into pieces of at most ``work_bytes`` of float32 (gathered K/V for a group of
decodes, scores for a chunk of a long prefill's queries), so unified memory holds no [L, L] score matrix of a long
prompt at once.

MPS op coverage (torch's MPS backend implements each natively, no CPU fallback): ``index_select`` (int64 ids),
``matmul`` of float32, ``masked_fill_``, ``softmax``, ``tanh``, ``arange``, comparisons and ``&`` of bools,
``index_put_`` (accumulate=False; the KV write and the decode rows' scatter), slicing assignment, dtype casts
between float16/bfloat16/float32. Avoided on purpose: float64 (MPS has none), float8 (no MPS dtype), boolean-mask
indexing in the hot path (``nonzero`` waits for the device), ``index_copy_`` (a slow MPS kernel before mid-2026
torch), anything from torch.cuda or Triton.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cvllm.forward_context import ForwardContext

# float32 bytes one piece of attention work may hold (gathered K and V, or scores): 256 MiB
WORK_BYTES = 256 << 20


@dataclass(slots=True)
class AttentionPart:
    """Rows of the flat batch attended together: ``B`` sequences of ``Lq`` queries each."""
    rows: slice | torch.Tensor      # where the queries are in the flat batch: a slice, or [B] token indices
    tables: torch.Tensor            # [B, blocks] int64 block ids (only the blocks the longest sequence uses)
    positions: torch.Tensor         # [B, Lq] int64 absolute positions of the queries
    lens: torch.Tensor              # [B] int64 keys in the cache per sequence (context + new)
    # layers share them: visibility per sliding window, and which keys lie past each sequence's end
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    past_end: torch.Tensor | None = None

    def visible(self, num_keys: int, window: int | None) -> torch.Tensor:
        """``[B, 1, 1, Lq, S]``: query position p sees key j when j <= p, j < len and p - j < window."""
        if window not in self.masks:
            j = torch.arange(num_keys, device=self.lens.device)
            p = self.positions[:, :, None]                                    # [B, Lq, 1]
            visible = (j <= p) & (j < self.lens[:, None, None])
            if window:
                visible &= (p - j) < window
            self.masks[window] = visible[:, None, None]
        return self.masks[window]

    def keys_past_end(self, num_keys: int) -> torch.Tensor:
        """``[B, 1, S, 1]``: key j of sequence b lies past its ``lens[b]`` keys."""
        if self.past_end is None:
            j = torch.arange(num_keys, device=self.lens.device)
            self.past_end = (j >= self.lens[:, None])[:, None, :, None]
        return self.past_end


@dataclass(slots=True)
class AttentionPlan:
    parts: list[AttentionPart]
    whole_batch: bool   # one part that is every row, in order: its output is the layer's, with no scatter

    def queries(self, q: torch.Tensor, part: AttentionPart) -> torch.Tensor:
        """The part's queries ``[B, Lq, H, D]`` of the flat batch ``[T, H, D]``: decodes [B, 1], a chunk [1, n]."""
        rows = q[part.rows] if isinstance(part.rows, slice) else q.index_select(0, part.rows)
        return rows.view(*part.positions.shape, *q.shape[1:])

    @classmethod
    def build(cls, ctx: ForwardContext) -> AttentionPlan:
        """From the host lists of the context; the device tensors are sliced, not read back (no sync)."""
        starts, qlens, seq_lens = ctx.query_start_loc_cpu, ctx.query_lens_cpu, ctx.seq_lens_cpu
        block_size, device = ctx.block_size, ctx.block_tables.device
        decodes = [i for i, n in enumerate(qlens) if n == 1]
        parts = []
        if decodes:
            blocks = -(-max(seq_lens[i] for i in decodes) // block_size)
            if len(decodes) == len(qlens):   # every row decodes (row i is sequence i): the context's own tensors
                rows, tables, lens = slice(0, len(qlens)), ctx.block_tables[:, :blocks], ctx.seq_lens
            else:
                index = torch.tensor(decodes, device=device)
                rows = torch.tensor([starts[i] for i in decodes], device=device)
                tables, lens = ctx.block_tables[:, :blocks].index_select(0, index), ctx.seq_lens.index_select(0, index)
            lens = lens.long()
            parts.append(AttentionPart(rows, tables.long(), (lens - 1)[:, None], lens))
        for i, n in enumerate(qlens):
            if n != 1:
                seq_len = seq_lens[i]
                positions = torch.arange(seq_len - n, seq_len, device=device)[None]
                parts.append(AttentionPart(slice(starts[i], starts[i] + n),
                                           ctx.block_tables[i:i + 1, :-(-seq_len // block_size)].long(), positions,
                                           ctx.seq_lens[i:i + 1].long()))
        whole = len(parts) == 1 and isinstance(parts[0].rows, slice) and parts[0].rows == slice(0, starts[-1])
        return cls(parts, whole)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The sequences' keys (or values) as contiguous float32 ``[B, Hkv, S, D]``: one index_select of whole blocks,
    then cast and transpose in one copy, so the matmuls fold (B, Hkv) into one batch dim without another copy."""
    B, Hkv, D = tables.shape[0], cache.shape[2], cache.shape[3]
    rows = cache.index_select(0, tables.reshape(-1)).view(B, -1, Hkv, D).transpose(1, 2)
    return torch.empty(rows.shape, dtype=torch.float32, device=rows.device).copy_(rows)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, part: AttentionPart, scale: float,
           sliding_window: int | None, soft_cap: float | None, work_bytes: int = WORK_BYTES) -> torch.Tensor:
    """Attention of ``q`` ``[B, Lq, H, D]`` (the part's queries) over the part's paged K/V; float32 inside,
    returned in q's dtype."""
    B, Lq, H, D = q.shape
    Hkv = k_cache.shape[2]
    S = part.tables.shape[1] * k_cache.shape[1]
    out = torch.empty_like(q)
    # sequences per group: their gathered float32 K and V fit the work budget (at least one)
    group = max(1, min(B, work_bytes // (Hkv * S * D * 4 * 2)))
    # queries per chunk: a chunk's float32 scores [group, H, chunk, S] fit the budget (at least one)
    chunk = max(1, min(Lq, work_bytes // (group * H * S * 4)))
    visible, past_end = part.visible(S, sliding_window), part.keys_past_end(S)
    for b0 in range(0, B, group):
        b1 = min(B, b0 + group)
        k = gather_blocks(k_cache, part.tables[b0:b1])
        # MLA's latent is both K and V (one cache): one gather serves both; zeroing K past the end changes nothing,
        # those scores are masked out anyway
        v = k if v_cache is k_cache else gather_blocks(v_cache, part.tables[b0:b1])
        # Keys past a sequence's end (the rest of its last block, padded table entries) meet a zero weight, but
        # 0 * NaN is NaN and the cache is never zero-filled (torch.empty): their values are zeroed
        v.masked_fill_(past_end[b0:b1], 0.0)
        for q0 in range(0, Lq, chunk):
            q1 = min(Lq, q0 + chunk)
            out[b0:b1, q0:q1] = _attend_chunk(q[b0:b1, q0:q1], k, v, visible[b0:b1, ..., q0:q1, :], scale, soft_cap)
    return out


def _attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                  soft_cap: float | None) -> torch.Tensor:
    """q ``[b, lq, H, D]``; k, v float32 ``[b, Hkv, S, D]``; visible ``[b, 1, 1, lq, S]``."""
    b, lq, H, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    # the G query heads of a KV head and the lq queries form the rows of one matmul per (sequence, KV head)
    qg = q.float().view(b, lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(b, Hkv, G * lq, D)
    scores = torch.matmul(qg, k.transpose(2, 3)).view(b, Hkv, G, lq, S) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    # every query sees at least itself (position p, key p < len; p - p < any window): no row is all -inf, no NaN
    probs = torch.softmax(scores.masked_fill_(~visible, float("-inf")), dim=-1)
    out = torch.matmul(probs.view(b, Hkv, G * lq, S), v).view(b, Hkv, G, lq, D)
    return out.permute(0, 3, 1, 2, 4).reshape(b, lq, H, D).to(q.dtype)
