"""MLA's decompressed form for prefill: keys and values made from the cached latents, then ordinary attention.

The absorbed form (mla.py) costs per query token and key, per head, a dot product of ``kv_lora_rank + rope``
values and a weighted sum of ``kv_lora_rank`` (576 + 512 for DeepSeek-V3), plus two ``kv_lora_rank x 128``
matmuls per query token and head. The decompressed form makes each key and value of the sequence once
(``kv_b_proj`` of its latent: ``kv_lora_rank x (nope + v)`` per key and head) and then costs ``nope + rope`` and
``v`` per query token and key (192 + 128): for q new tokens over s keys it is the cheaper one when

    q * s * (absorbed pair - decompressed pair) + q * kv_lora * (nope + v)  >  s * kv_lora * (nope + v),

i.e. a prompt, or a chunk of more than ~170 tokens however long the context. A step with such sequences writes
every token's latent into the cache, runs the absorbed attention over a sub-batch of the others (decode tokens,
short chunks) and the decompressed one sequence by sequence (prefill steps are not captured in graphs; a loop
over a step's few prefill sequences is cheap next to their attention). The keys come from the cache, so prefix
caching and chunked prefill read what earlier steps wrote. 16-bit and float32 caches only: an FP8 cache keeps the
absorbed form.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from cvllm.forward_context import ForwardContext
from cvllm.layers import kv_fp8

# On CUDA the absorbed Triton kernel is faster for now: DeepSeek-V2-Lite's TTFT at 1k / 4k tokens was 49.6 / 163.5 ms
# absorbed, 64.3 / 219.4 decompressed (torch's SDPA: keys of 192 against values of 128 with a bottom-right causal
# mask leave it its slower kernels; bench/results/2026-12-02-h200-latency-deepseek-v2-lite-*8249fc2.json). So by
# default the decompressed form runs where the cache is not on a GPU; CVLLM_MLA_DECOMPRESS=1 / 0: always / never.
_SWITCH = os.environ.get("CVLLM_MLA_DECOMPRESS")


@dataclass(slots=True)
class PrefillSplit:
    decompress: list[int]                                  # sequences that take the decompressed form
    absorbed: tuple[ForwardContext, torch.Tensor] | None   # the others as a sub-batch, and their rows in the step


def split_step(ctx: ForwardContext, layer) -> PrefillSplit | None:
    """How this step's sequences split between the two forms, or None when every one takes the absorbed form
    (decode steps, short chunks, an FP8 cache). Worked out once per forward pass, for every MLA layer."""
    if "mla_prefill" not in ctx.per_step:
        ctx.per_step["mla_prefill"] = _split(ctx, layer)
    return ctx.per_step["mla_prefill"]


def _split(ctx: ForwardContext, layer) -> PrefillSplit | None:
    cache = layer.attn.k_cache
    enabled = cache.device.type != "cuda" if _SWITCH is None else _SWITCH != "0"
    # (a graph's capture: its steps' lengths are not known yet, and the absorbed form is right for any)
    if ctx.is_decode_only or ctx.capturing or kv_fp8.is_fp8(cache) or not enabled:
        return None
    made = layer.kv_lora_rank * (layer.nope + layer.v_head_dim)     # a key and value made, per head
    saved = (2 * layer.kv_lora_rank + layer.rope) - (layer.nope + layer.rope + layer.v_head_dim)  # per pair
    decompress = [i for i, (q, s) in enumerate(zip(ctx.query_lens_cpu, ctx.seq_lens_cpu))
                  if q > 1 and q * s * saved + q * made > s * made]
    if not decompress:
        return None
    chosen = set(decompress)
    absorbed = [i for i in range(len(ctx.seq_lens_cpu)) if i not in chosen]
    return PrefillSplit(decompress, sub_context(ctx, absorbed) if absorbed else None)


def sub_context(ctx: ForwardContext, seqs: list[int]) -> tuple[ForwardContext, torch.Tensor]:
    """The step restricted to sequences ``seqs`` (prepared by the backend), and their tokens' rows in the step."""
    device = ctx.query_start_loc.device
    q_lens = [ctx.query_lens_cpu[i] for i in seqs]
    seq_lens = [ctx.seq_lens_cpu[i] for i in seqs]
    rows = torch.cat([torch.arange(ctx.query_start_loc_cpu[i], ctx.query_start_loc_cpu[i + 1]) for i in seqs])
    rows = rows.to(device, non_blocking=True)
    index = torch.tensor(seqs, device=device)
    starts = [0, *accumulate(q_lens)]
    sub = ForwardContext(
        backend=ctx.backend, query_start_loc=torch.tensor(starts, dtype=ctx.query_start_loc.dtype, device=device),
        seq_lens=ctx.seq_lens[index], slot_mapping=ctx.slot_mapping[rows], block_tables=ctx.block_tables[index],
        query_start_loc_cpu=starts, query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), is_decode_only=all(q == 1 for q in q_lens), block_size=ctx.block_size)
    ctx.backend.prepare(sub)
    return sub, rows


def decompressed_attention(layer, ctx: ForwardContext, seq: int, q_nope: torch.Tensor,
                           q_pe: torch.Tensor) -> torch.Tensor:
    """Sequence ``seq``'s new tokens (``q_nope [q, H, nope]``, rotated ``q_pe [q, H, rope]``) over all its keys,
    made from the latents in the cache: ``[q, H, v_head_dim]``."""
    cache = layer.attn.k_cache                                  # [blocks, block_size, 1, kv_lora + rope]
    keys, block_size = ctx.seq_lens_cpu[seq], cache.shape[1]
    blocks = ctx.block_tables[seq, : -(-keys // block_size)]
    latent, k_pe = cache[blocks].reshape(-1, cache.shape[-1])[:keys].split([layer.kv_lora_rank, layer.rope], -1)
    heads = layer.num_heads
    kv = F.linear(latent, layer.kv_b_weight).view(keys, heads, layer.nope + layer.v_head_dim)
    k_nope, value = kv.split([layer.nope, layer.v_head_dim], dim=-1)
    key = torch.cat([k_nope, k_pe[:, None].expand(keys, heads, layer.rope)], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1)
    # the new tokens are the last q positions: causal from the bottom-right corner
    mask = causal_lower_right(query.shape[0], keys)
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                         attn_mask=mask, scale=layer.attn.scale)
    return out.transpose(0, 1)
