"""The CPU backend: torch reference implementations, and the oracle other backends are checked against."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from cvllm.backends.base import Backend


def _available_memory() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 2, total


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_pos: torch.Tensor, kv_lens: torch.Tensor,
                              scale: float, sliding_window: int | None, soft_cap: float | None) -> torch.Tensor:
    """Attention for ``B`` sequences of ``Lq`` queries each over their paged K/V, in fp32.

    q: [B, Lq, H, D]; block_tables: [B, nb]; query_pos: [B, Lq] absolute positions (-1 = padding);
    kv_lens: [B]. Key j is visible to query position p when j <= p, j < kv_len and p - j < window.
    """
    B, Lq, H, D = q.shape
    Hkv = k_cache.shape[2]
    k = k_cache[block_tables].flatten(1, 2).float()      # [B, S, Hkv, D]
    v = v_cache[block_tables].flatten(1, 2).float()
    S, G = k.shape[1], H // Hkv
    qg = q.float().view(B, Lq, Hkv, G, D)
    scores = torch.einsum("bqhgd,bshd->bhgqs", qg, k) * scale   # [B, Hkv, G, Lq, S]
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    j = torch.arange(S, device=q.device)
    p = query_pos[:, :, None]                                    # [B, Lq, 1]
    visible = (j <= p) & (j < kv_lens[:, None, None])
    if sliding_window:
        visible &= (p - j) < sliding_window
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # padded query rows see nothing
    out = torch.einsum("bhgqs,bshd->bqhgd", probs, v)
    return out.reshape(B, Lq, H, D).to(q.dtype)


class CpuBackend(Backend):
    name = "cpu"
    device = torch.device("cpu")
    dist_backend = "gloo"
    default_dtype = torch.float32

    @classmethod
    def is_available(cls) -> bool:
        return True

    def memory(self) -> tuple[int, int]:
        return _available_memory()

    def __init__(self) -> None:
        # every layer of a forward pass writes through the same slot mapping: look for padding once
        self._slots_seen: torch.Tensor | None = None
        self._slots_kept: torch.Tensor | None = None

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        if slot_mapping is not self._slots_seen:
            self._slots_seen = slot_mapping
            padded = slot_mapping.numel() and int(slot_mapping.min()) < 0  # -1: a token whose K/V is not stored
            self._slots_kept = (slot_mapping >= 0) if padded else None
        if self._slots_kept is not None:
            keep = self._slots_kept
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Any,
                  layer: Any) -> torch.Tensor:
        if ctx.backend_data is None:  # the same for every layer: work it out once per forward pass
            ctx.backend_data = _AttentionPlan.build(ctx, k_cache.shape[1])
        plan: _AttentionPlan = ctx.backend_data
        args = (layer.scale, layer.sliding_window, layer.logits_soft_cap)
        out = torch.empty_like(q)
        if plan.decode_tokens is not None:
            # All single-token rows in one padded batch: gathers the blocks they use, one einsum.
            o = paged_attention_reference(q[plan.decode_tokens][:, None], k_cache, v_cache, plan.decode_tables,
                                          plan.decode_positions, plan.decode_lens, *args)
            out[plan.decode_tokens] = o[:, 0]
        for start, n, tables, positions, lens in plan.prefills:
            o = paged_attention_reference(q[None, start:start + n], k_cache, v_cache, tables, positions, lens, *args)
            out[start:start + n] = o[0]
        return out


@dataclass(slots=True)
class _AttentionPlan:
    decode_tokens: torch.Tensor | None      # [Bd] rows of the flat batch that decode one token
    decode_tables: torch.Tensor | None      # [Bd, blocks]
    decode_positions: torch.Tensor | None   # [Bd, 1]
    decode_lens: torch.Tensor | None        # [Bd]
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]

    @classmethod
    def build(cls, ctx: Any, block_size: int) -> _AttentionPlan:
        starts, qlens, seq_lens = ctx.query_start_loc_cpu, ctx.query_lens_cpu, ctx.seq_lens_cpu
        rows = [i for i, n in enumerate(qlens) if n == 1]
        plan = cls(None, None, None, None, [])
        if rows:
            index = torch.tensor(rows)
            plan.decode_tokens = torch.tensor([starts[i] for i in rows])
            plan.decode_lens = ctx.seq_lens[index]
            plan.decode_positions = (plan.decode_lens - 1)[:, None]
            plan.decode_tables = ctx.block_tables[index, :-(-max(seq_lens[i] for i in rows) // block_size)]
        for i, n in enumerate(qlens):
            if n != 1:
                seq_len = seq_lens[i]
                plan.prefills.append((starts[i], n, ctx.block_tables[i:i + 1, :-(-seq_len // block_size)],
                                      torch.arange(seq_len - n, seq_len)[None], ctx.seq_lens[i:i + 1]))
        return plan
