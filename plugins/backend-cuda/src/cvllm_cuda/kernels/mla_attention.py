"""Multi-head latent attention (DeepSeek's MLA, absorbed form) over a paged latent cache.

The cache holds one vector per token, ``[latent ‖ rope]`` (kv_lora_rank + qk_rope_head_dim: 512 + 64 for
DeepSeek-V3), shared by every head: keys and values at once. Head h's query is ``[q_latent ‖ q_rope]`` of the same
width; its score against key j is ``q_latent . latent_j + q_rope . rope_j`` and its output the softmax-weighted
sum of the latents (``latent`` wide: the model multiplies it by W_UV). The generic paged attention
(paged_attention.py) would pad 576 to 1024 and put all 128 heads of the one KV head in one tile; here the two parts
are loaded separately (both powers of two), each program takes BLOCK_H heads of one query token, and a key block's
latents serve as keys and, transposed, as values: one load.

Prefill and decode alike (a token per program row block, its causal keys); split over the keys for long contexts
like the generic kernel, whose ``combine_splits`` (attention_splits.py) adds the slices. Launches read nothing
back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu, pdl
from cvllm_cuda.kernels.attention_splits import combine_splits
from cvllm_cuda.kernels.paged_attention import MAX_SPLITS, _find_sequence
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

BLOCK_H = 16   # heads per program: tl.dot's smallest M
BLOCK_N = 32   # keys per step


def usable(latent: int, rope: int) -> bool:
    """The kernel's part widths: powers of two of at least 16 (tl.dot's smallest K)."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (latent, rope))


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _mla_kernel(
    q_ptr, cache_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr, num_seqs, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_bt,
    NUM_HEADS: tl.constexpr, LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, DECODE_ONLY: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP8: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    tile, chunk, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if FP8:   # e4m3 latents: the K scale folds into the softmax scale, the V scale into the output
        scale = scale * tl.load(k_scale_ptr)
    if DECODE_ONLY:
        seq = tile
        q_start = tl.load(query_start_loc_ptr + seq)
        q_index = 0
    else:   # one token per tile; _find_sequence's layout of tiles with BLOCK_Q = 1 (a spare one per sequence)
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, 1)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_index = tile - (q_start + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_index >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - q_len + q_index
    token = (q_start + q_index).to(tl.int64)

    heads = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    lat, rope = tl.arange(0, LATENT), tl.arange(0, ROPE)
    q_row = q_ptr + token * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + lat[None, :], mask=head_ok[:, None], other=0.0)           # [BLOCK_H, LATENT]
    q_rope = tl.load(q_row + LATENT + rope[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, ROPE]

    kv_end = q_pos + 1   # causal: keys 0 .. q_pos
    steps_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS)
    split_begin = split * steps_per_split * BLOCK_N
    split_end = tl.minimum(kv_end, split_begin + steps_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, LATENT], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(split_begin, split_end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < split_end
        page = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        row = cache_ptr + page * stride_cb + (keys % BLOCK_SIZE) * stride_cs
        latent = tl.load(row[None, :] + lat[:, None], mask=key_ok[None, :], other=0.0)           # [LATENT, N]
        k_rope = tl.load(row[None, :] + LATENT + rope[:, None], mask=key_ok[None, :], other=0.0)  # [ROPE, N]
        if FP8:
            latent, k_rope = latent.to(q_lat.dtype), k_rope.to(q_lat.dtype)
        s = tl.dot(q_lat, latent, input_precision=DOT_PRECISION)
        s = tl.dot(q_rope, k_rope, s, input_precision=DOT_PRECISION) * scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet: exp() gives 0, not NaN
        p = tl.exp(s - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), tl.trans(latent), input_precision=DOT_PRECISION)
        m_i = m_new

    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    out_mask = head_ok[:, None]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + lat[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:   # workspace [T, H, NUM_SPLITS] (and [.., LATENT]), as the generic kernel's
        part = (token * NUM_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=head_ok)
        tl.store(part_sum_ptr + part, l_i, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * LATENT + lat[None, :], acc, mask=out_mask)


def mla_attention(q: torch.Tensor, cache: torch.Tensor, latent: int, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                  num_splits: int | None = None,
                  kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``q [T, H, latent + rope]`` over ``cache [num_blocks, block_size, 1, latent + rope]`` (varlen queries as
    paged_attention takes them): ``[T, H, latent]``, each head's softmax-weighted sum of the latents. An FP8
    cache (float8_e4m3fn) takes ``kv_scales``, its values' K and V scales (float32 [1] each)."""
    num_tokens, num_heads, width = q.shape
    _, block_size, kv_heads, cache_width = cache.shape
    rope = width - latent
    assert kv_heads == 1 and cache_width == width and usable(latent, rope), (q.shape, cache.shape, latent)
    fp8 = cache.dtype == torch.float8_e4m3fn
    assert fp8 == (kv_scales is not None), "an FP8 cache needs its scales (and only an FP8 cache)"
    assert (q.dtype == cache.dtype or fp8) and q.stride(-1) == 1 and cache.stride(-1) == 1
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, latent), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    decode = max_query_len == 1
    chunks = cdiv(num_heads, BLOCK_H)
    if num_splits is None:   # long decodes of few sequences: enough programs to fill the GPU
        sms = gpu.num_sms(gpu.device_index(q.device)) if q.is_cuda else 4
        num_splits = cdiv(2 * sms, num_seqs * chunks) if decode else 1
    splits = min(MAX_SPLITS, next_power_of_2(num_splits))
    if splits > 1:
        part_max = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_tokens, num_heads, splits, latent), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out
    tiles = num_seqs if decode else num_tokens + num_seqs
    launch = pdl.options(q.device)
    _mla_kernel[(tiles, chunks, splits)](
        q, cache, out, part_max, part_sum, part_acc, query_start_loc, seq_lens, block_tables,
        *(kv_scales or (seq_lens, seq_lens)), num_seqs, float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), NUM_HEADS=num_heads, LATENT=latent, ROPE=rope, BLOCK_SIZE=block_size,
        BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, NUM_SPLITS=splits, DECODE_ONLY=decode,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8, num_warps=4, num_stages=2,
        **launch)
    if splits > 1:
        combine_splits(out, part_max, part_sum, part_acc)
    return out
