"""The CPU backend: torch reference implementations, and the oracle other backends are checked against."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from cvllm.backends import cpu_kernels, cpu_kind
from cvllm.backends.base import Backend
from cvllm.backends.cpu_decode import DecodeKeys, GatherBuffers, chunk_attention, decode_attention
from cvllm.backends.cpu_fused import make_fused_kernels
from cvllm.engine.ngram_device import advance_ngram_host
from cvllm.forward_context import ForwardContext
from cvllm.layers import kv_fp8

KV_CACHE_BYTES = 4 << 30   # the KV pool by default, at most (vLLM's CPU default is 4 GiB too)
DECODE_CHUNK = 16          # chunks of up to this many tokens attend as decode steps would (cpu_decode.chunk_attention)


def _available_memory() -> tuple[int, int]:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"], info["MemTotal"]
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 2, total


def visible_keys(query_pos: torch.Tensor, kv_lens: torch.Tensor, num_keys: int,
                 sliding_window: int | None) -> torch.Tensor:
    """``[B, 1, 1, Lq, S]``: key j is visible to query position p when j <= p, j < kv_len and p - j < window."""
    j = torch.arange(num_keys, device=query_pos.device)
    p = query_pos[:, :, None]                                    # [B, Lq, 1]
    visible = (j <= p) & (j < kv_lens[:, None, None])
    if sliding_window:
        visible &= (p - j) < sliding_window
    return visible[:, None, None]


def keys_past_end(kv_lens: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, 1, S, 1]``: key j of sequence b lies past its ``kv_lens[b]`` keys (masks the gathered values)."""
    return (torch.arange(num_keys, device=kv_lens.device) >= kv_lens[:, None])[:, None, :, None]


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_pos: torch.Tensor, kv_lens: torch.Tensor,
                              scale: float, sliding_window: int | None, soft_cap: float | None,
                              visible: torch.Tensor | None = None,
                              past_end: torch.Tensor | None = None,
                              kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention for ``B`` sequences of ``Lq`` queries each over their paged K/V, in fp32.

    q: [B, Lq, H, D]; block_tables: [B, nb]; query_pos: [B, Lq] absolute positions (-1 = padding);
    kv_lens: [B]. ``visible`` is ``visible_keys(...)`` and ``past_end`` is ``keys_past_end(...)`` when the caller has
    them already (they are the same for every layer of a forward pass).
    """
    B, Lq, H, D = q.shape
    Hkv = k_cache.shape[2]
    G = H // Hkv
    blocks = block_tables.reshape(-1).long()  # index_select with int64 ids: far cheaper than advanced indexing
    S = block_tables.shape[1] * k_cache.shape[1]

    def gather(cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The sequences' keys or values as contiguous fp32 [B, Hkv, S, D]: cast and transpose in one copy,
        so the batched matmuls below fold (B, Hkv) into one batch dim without copying again."""
        if scale is not None:   # FP8, gathered as bytes: torch has no index_select of float8
            rows = cache.view(torch.uint8).index_select(0, blocks).view(cache.dtype)
        else:
            rows = cache.index_select(0, blocks)
        rows = rows.view(B, S, Hkv, D).transpose(1, 2)
        out = torch.empty(rows.shape, dtype=torch.float32, device=rows.device).copy_(rows)
        return out if scale is None else out.mul_(scale.view(1, -1, 1, 1))   # [B, Hkv, S, D]: per KV head

    k, v = gather(k_cache, kv_scales and kv_scales[0]), gather(v_cache, kv_scales and kv_scales[1])
    # Keys past a sequence's length (the rest of its last block, padded table entries) are masked out of the
    # scores, but their values still meet a zero weight in the matmul, and 0 * NaN is NaN: the cache is never
    # zero-filled, so what lies there is whatever the memory held
    v.masked_fill_(keys_past_end(kv_lens, S) if past_end is None else past_end, 0.0)
    # the G query heads of a KV head and the Lq queries form the rows of one matmul per (sequence, KV head)
    qg = q.float().view(B, Lq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * Lq, D)
    scores = torch.matmul(qg, k.transpose(2, 3)).view(B, Hkv, G, Lq, S) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    if visible is None:
        visible = visible_keys(query_pos, kv_lens, S, sliding_window)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    if Lq > 1:
        probs = probs.nan_to_num_(0.0)  # padded query rows see nothing (a decode row always sees itself)
    out = torch.matmul(probs.view(B, Hkv, G * Lq, S), v).view(B, Hkv, G, Lq, D)
    return out.permute(0, 3, 1, 2, 4).reshape(B, Lq, H, D).to(q.dtype)


class CpuBackend(Backend):
    name = "cpu"
    priority = 0   # always available: chosen when nothing better is
    device = torch.device("cpu")
    dist_backend = "gloo"
    default_dtype = torch.float32
    fused_decode = True   # decode rows through SDPA (cpu_decode.py); False: the float32 reference (A/B measurements)
    fused_kernels = True  # small bf16 add + RMSNorm in C (cpu_kernels.py); False: torch code (A/B measurements)
    # a draft is a row more of every matmul: ~0.15-0.3 of a decode step each on the demo model (2 cores, AVX-512;
    # bench/speculative.py with K = 2 and 4, docs/benchmarks.md)
    draft_token_cost = 0.2
    # device drafts' step on the host it runs on: its own substring search, not torch ops over every position
    advance_ngram = staticmethod(advance_ngram_host)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def memory(self) -> tuple[int, int]:
        return _available_memory()

    def default_kv_cache_bytes(self, free: int) -> int:
        return min(KV_CACHE_BYTES, free // 2)   # host memory: the server and everything else need theirs

    def __init__(self) -> None:
        # every layer of a forward pass writes through the same slot mapping: look for padding once
        self._slots_seen: torch.Tensor | None = None
        self._slots_kept: torch.Tensor | None = None
        self._gather_buffers = GatherBuffers()
        cpu_kind.log_kind()
        # the decode rows' add + RMSNorm as one C call (cpu_kernels.py); None: torch code
        lib = cpu_kernels.load() if self.fused_kernels else None
        if lib is not None:
            for name, kernel in make_fused_kernels(lib).items():
                setattr(self, name, kernel)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping, scales=None) -> None:
        if slot_mapping is not self._slots_seen:
            self._slots_seen = slot_mapping
            padded = slot_mapping.numel() and int(slot_mapping.min()) < 0  # -1: a token whose K/V is not stored
            self._slots_kept = (slot_mapping >= 0) if padded else None
        if self._slots_kept is not None:
            keep = self._slots_kept
            k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
        if scales is not None:   # an FP8 cache, its bytes copied as bytes (torch has no index_copy_ of float8)
            k, v = kv_fp8.quantize(k, scales[0]).view(torch.uint8), kv_fp8.quantize(v, scales[1]).view(torch.uint8)
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def prepare(self, ctx: ForwardContext) -> None:
        ctx.backend_data = _AttentionPlan.build(ctx)   # the same for every layer: worked out once per forward pass

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: Any,
                  layer: Any) -> torch.Tensor:
        plan = ctx.backend_data
        assert isinstance(plan, _AttentionPlan), "the forward pass's ctx was not prepared (Backend.prepare)"
        args = (layer.scale, layer.sliding_window, layer.logits_soft_cap)
        # an FP8 cache: the stored values times the layer's scales, in float32
        scales = (layer.k_scale, layer.v_scale) if kv_fp8.is_fp8(k_cache) else None
        fused = self.fused_decode and scales is None and not layer.logits_soft_cap   # SDPA has neither
        if plan.decode_only:  # every row decodes one token, in order: no gather or scatter of rows
            if fused:
                return decode_attention(q, k_cache, v_cache, plan.decode_keys(layer.sliding_window), layer.scale,
                                        self._gather_buffers)
            return paged_attention_reference(q[:, None], k_cache, v_cache, plan.decode_tables, plan.decode_positions,
                                             plan.decode_lens, *args, plan.visible(-1, layer.sliding_window),
                                             plan.past_end(-1), scales)[:, 0]
        out = torch.empty_like(q)
        if plan.decode_tokens is not None and fused:
            out[plan.decode_tokens] = decode_attention(q[plan.decode_tokens], k_cache, v_cache,
                                                       plan.decode_keys(layer.sliding_window), layer.scale,
                                                       self._gather_buffers)
        elif plan.decode_tokens is not None:
            # All single-token rows in one padded batch: gathers the blocks they use, one einsum.
            o = paged_attention_reference(q[plan.decode_tokens][:, None], k_cache, v_cache, plan.decode_tables,
                                          plan.decode_positions, plan.decode_lens, *args,
                                          plan.visible(-1, layer.sliding_window), plan.past_end(-1), scales)
            out[plan.decode_tokens] = o[:, 0]
        for i, (start, n, seq_len, tables, positions, lens) in enumerate(plan.prefills):
            if fused and n <= DECODE_CHUNK:   # a verify step's tokens: each as a decode step would attend
                out[start:start + n] = chunk_attention(q[start:start + n], k_cache, v_cache, tables, seq_len,
                                                       plan.block_size, layer.sliding_window, layer.scale,
                                                       self._gather_buffers)
                continue
            o = paged_attention_reference(q[None, start:start + n], k_cache, v_cache, tables, positions, lens, *args,
                                          plan.visible(i, layer.sliding_window), plan.past_end(i), scales)
            out[start:start + n] = o[0]
        return out


@dataclass(slots=True)
class _AttentionPlan:
    decode_tokens: torch.Tensor | None      # [Bd] rows of the flat batch that decode one token
    decode_tables: torch.Tensor | None      # [Bd, blocks]
    decode_positions: torch.Tensor | None   # [Bd, 1]
    decode_lens: torch.Tensor | None        # [Bd]
    decode_lens_cpu: list[int]
    # (first row, rows, kv length, block tables, query positions, kv lengths) of each chunk of more than one token
    prefills: list[tuple[int, int, int, torch.Tensor, torch.Tensor, torch.Tensor]]
    block_size: int = 0
    decode_only: bool = False               # decode_tokens is every row of the batch, in order
    # visibility masks by (prefill index or -1 for the decode rows, sliding window): layers share them
    masks: dict[tuple[int, int | str | None], torch.Tensor] = field(default_factory=dict)
    spans: dict[int | None, DecodeKeys] = field(default_factory=dict)   # the decode rows' keys, by sliding window

    @classmethod
    def build(cls, ctx: ForwardContext) -> _AttentionPlan:
        starts, qlens, seq_lens = ctx.query_start_loc_cpu, ctx.query_lens_cpu, ctx.seq_lens_cpu
        block_size = ctx.block_size
        rows = [i for i, n in enumerate(qlens) if n == 1]
        plan = cls(None, None, None, None, [], [], block_size)
        if rows:
            index = torch.tensor(rows)
            plan.decode_tokens = torch.tensor([starts[i] for i in rows])
            plan.decode_lens = ctx.seq_lens[index]
            plan.decode_lens_cpu = [seq_lens[i] for i in rows]
            plan.decode_positions = (plan.decode_lens - 1)[:, None]
            plan.decode_tables = ctx.block_tables[index, :-(-max(seq_lens[i] for i in rows) // block_size)].long()
            plan.decode_only = len(rows) == len(qlens) and starts[:len(rows)] == list(range(len(rows)))
        for i, n in enumerate(qlens):
            if n != 1:
                seq_len = seq_lens[i]
                plan.prefills.append((starts[i], n, seq_len,
                                      ctx.block_tables[i:i + 1, :-(-seq_len // block_size)].long(),
                                      torch.arange(seq_len - n, seq_len)[None], ctx.seq_lens[i:i + 1]))
        return plan

    def _part(self, part: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(block tables, query positions, kv lengths) of the decode rows (-1) or of prefill ``part``."""
        if part < 0:
            return self.decode_tables, self.decode_positions, self.decode_lens
        return self.prefills[part][3:]

    def visible(self, part: int, sliding_window: int | None) -> torch.Tensor:
        key = (part, sliding_window)
        if key not in self.masks:
            tables, positions, lens = self._part(part)
            self.masks[key] = visible_keys(positions, lens, tables.shape[1] * self.block_size, sliding_window)
        return self.masks[key]

    def decode_keys(self, sliding_window: int | None) -> DecodeKeys:
        if sliding_window not in self.spans:
            self.spans[sliding_window] = DecodeKeys.build(self.decode_tables, self.decode_lens_cpu, self.block_size,
                                                          sliding_window)
        return self.spans[sliding_window]

    def past_end(self, part: int) -> torch.Tensor:
        key = (part, "past_end")
        if key not in self.masks:
            tables, _, lens = self._part(part)
            self.masks[key] = keys_past_end(lens, tables.shape[1] * self.block_size)
        return self.masks[key]
