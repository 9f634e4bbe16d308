"""Decode attention over an FP8 cache with the products taken in e4m3 on the tensor cores (an experiment, off by
default: ``CVLLM_FP8_ATTENTION_DOTS=2`` or ``=1``).

paged_attention's kernel converts every e4m3 key and value it reads to float16 before its products (128 conversions a
thread a 64-key step), and its 16-row tiles (4 query heads of a KV head, padded) compile to ``mma.sync``. Here the
tile is turned over: a program's keys are the rows and its query heads the columns (padded to 16), so that
S^T = K @ q^T and O^T = V^T @ P^T have 64 or more rows and Triton emits Hopper's ``wgmma`` with both operands e4m3
straight from shared memory (K's dims and, with V by key, V's keys lie contiguous along each reduction, as 8-bit
operands must). Nothing of the cache is converted: instead q (once a program) and P (a [keys, 16] tile a step) are
rounded to e4m3, q with a scale a head so that its largest element is 448, P times 256 (probabilities stay normal
numbers down to 2**-14).

Rounding q and P to e4m3 loses bits the float16 path keeps (3 mantissa bits against 10 and bf16's 7). ``TERMS=2``
takes each as the sum of two e4m3 terms, x ~ hi + lo with lo = e4m3(x - hi), and each product as two, which keeps
~7 bits: about what the float16 path computes from bf16 queries, for twice the (cheap) tensor-core work.
``TERMS=1`` is one term: FlashAttention-3's FP8 trade, less accurate. Decode batches only (one query a sequence),
V laid out by key, head dims of 32-256 (powers of two), up to 16 query heads a KV head.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.attention_step import _tanh
from cvllm_cuda.kernels.fp8_linear import _round_to_e4m3
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel

# "" (off), "1" or "2": the terms of q and P (module docstring); read at import, as the other A/B switches are
TERMS = int(os.environ.get("CVLLM_FP8_ATTENTION_DOTS", "0") or 0)
COLUMNS = tl.constexpr(16)       # query heads of a KV head, padded: Triton takes wgmma from 16 columns
P_SCALE = tl.constexpr(256.0)    # P (<= 1) times this in e4m3: up to 256 of 448; normal from 2**-14, zero below 2**-18
DEFAULT_TILE = (64, 3)   # keys a step (wgmma's M: a multiple of 64), pipeline stages; one warpgroup (4 warps)


def applies(decode: bool, values_by_key: bool, head_dim: int, group: int) -> bool:
    """Whether an FP8-cache attention launch takes this kernel (the switch on, and a shape it serves)."""
    return (TERMS in (1, 2) and decode and values_by_key and group <= COLUMNS.value
            and 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0)


@triton.jit
def _e4m3_terms(x, TERMS: tl.constexpr):
    """float32 x (|x| <= 448) as e4m3 (hi, lo) with hi + lo ~ x; lo is zero when TERMS == 1. Rounded by hand (the
    GPU's conversion rounds so too; Triton 3.6's interpreter carries wrongly: fp8_linear._round_to_e4m3)."""
    hi = _round_to_e4m3(x)
    if TERMS == 2:
        lo = _round_to_e4m3(x - hi)
    else:
        lo = hi * 0.0
    return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)


@triton.jit
def _attend_keys_fp8(acc, m_i, l_i, q_hi, q_lo, score_scale, start, split_end, q_pos, table, k_cache_ptr,
                     v_cache_ptr, kv_head, dims, soft_cap, sliding_window, stride_cb, stride_cs, stride_ch,
                     stride_vb, stride_vh, stride_vd, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, TERMS: tl.constexpr,
                     MASKED: tl.constexpr):
    """(acc^T [D, 16], m_i [16], l_i [16]) after keys start .. start + BLOCK_N - 1 (those below ``split_end``);
    ``MASKED`` as in attention_step.attend_keys (slots past a sequence may hold NaN)."""
    keys = start + tl.arange(0, BLOCK_N)
    key_valid = keys < split_end
    if MASKED:
        page = tl.load(table + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        k = tl.load(k_cache_ptr + ((page * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None]
                                   + dims[None, :]), mask=key_valid[:, None], other=0.0)
    else:
        page = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_cache_ptr + ((page * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None]
                                   + dims[None, :]))   # [BLOCK_N, D]
    s = tl.dot(k, q_hi)   # [BLOCK_N, 16]
    if TERMS == 2:
        s = tl.dot(k, q_lo, s)
    s = s * score_scale[None, :]
    if USE_SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    visible = key_valid
    if USE_WINDOW:
        visible = visible & (q_pos - keys < sliding_window)
    s = tl.where(visible[:, None], s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)   # a column that has seen no key: exp(-inf) = 0, not NaN
    p = tl.exp(s - m_ref[None, :])
    alpha = tl.exp(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 0)

    RUN: tl.constexpr = min(BLOCK_SIZE, BLOCK_N)   # a page's keys contiguous for each dim (V by key)
    value_offset = (page * stride_vb + kv_head * stride_vh + keys % BLOCK_SIZE)[None, :] + dims[:, None] * stride_vd
    value_offset = tl.max_contiguous(tl.multiple_of(value_offset, [1, RUN]), [1, RUN])
    if MASKED:
        page_valid = (keys // BLOCK_SIZE) * BLOCK_SIZE < split_end
        v = tl.load(v_cache_ptr + value_offset, mask=page_valid[None, :], other=0.0)
        v = tl.where(key_valid[None, :], v, 0.0)   # [D, BLOCK_N]
    else:
        v = tl.load(v_cache_ptr + value_offset)
    p_hi, p_lo = _e4m3_terms(p * P_SCALE, TERMS)
    acc = acc * alpha[None, :]
    acc = tl.dot(v, p_hi, acc)
    if TERMS == 2:
        acc = tl.dot(v, p_lo, acc)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_bt"])
def _fp8_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr, scale, soft_cap, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, TERMS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """A program: one sequence's query, one KV head's G query heads (columns), one slice of its keys."""
    wait_for_previous_kernel(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    if tl.load(query_start_loc_ptr + seq + 1) == token:   # a sequence without a query this step
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    q_pos = seq_len - 1

    cols = tl.arange(0, COLUMNS)
    head = kv_head * G + cols
    col_valid = cols < G
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token * stride_qt + head[None, :] * stride_qh + dims[:, None], mask=col_valid[None, :],
                other=0.0).to(tl.float32)   # q^T [D, 16]
    # a scale a head: its largest |q| becomes 448, e4m3's largest; a zero head keeps a tiny one (0 / tiny = 0)
    q_scale = tl.maximum(tl.max(tl.abs(q), 0) / 448.0, 1e-30)
    q_hi, q_lo = _e4m3_terms(tl.minimum(tl.maximum(q / q_scale[None, :], -448.0), 448.0), TERMS)
    score_scale = scale * tl.load(k_scale_ptr + kv_head) * q_scale

    kv_begin = seq_len * 0
    if USE_WINDOW:   # steps start on a multiple of BLOCK_N; the window masks the rest
        kv_begin = tl.maximum(q_pos - sliding_window + 1, 0) // BLOCK_N * BLOCK_N
    steps_per_split = tl.cdiv(tl.cdiv(seq_len - kv_begin, BLOCK_N), NUM_SPLITS)
    split_begin = kv_begin + split * steps_per_split * BLOCK_N
    split_end = tl.minimum(seq_len, split_begin + steps_per_split * BLOCK_N)

    m_i = tl.full([COLUMNS], float("-inf"), tl.float32)
    l_i = tl.zeros([COLUMNS], tl.float32)
    acc = tl.zeros([HEAD_DIM, COLUMNS], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    whole_steps = tl.maximum((split_end - split_begin) // BLOCK_N, 0)
    clean_end = split_begin + whole_steps * BLOCK_N
    for start in range(split_begin, clean_end, BLOCK_N):
        acc, m_i, l_i = _attend_keys_fp8(
            acc, m_i, l_i, q_hi, q_lo, score_scale, tl.multiple_of(start, BLOCK_N), split_end, q_pos, table,
            k_cache_ptr, v_cache_ptr, kv_head, dims, soft_cap, sliding_window, stride_cb, stride_cs, stride_ch,
            stride_vb, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFT_CAP, TERMS, False)
    if clean_end < split_end:
        acc, m_i, l_i = _attend_keys_fp8(
            acc, m_i, l_i, q_hi, q_lo, score_scale, tl.multiple_of(clean_end, BLOCK_N), split_end, q_pos, table,
            k_cache_ptr, v_cache_ptr, kv_head, dims, soft_cap, sliding_window, stride_cb, stride_cs, stride_ch,
            stride_vb, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFT_CAP, TERMS, True)
    acc = acc * (tl.load(v_scale_ptr + kv_head) / P_SCALE)

    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[None, :]
        tl.store(out_ptr + token * stride_ot + head[None, :] * stride_oh + dims[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=col_valid[None, :])
    else:
        # the workspace paged_attention's combining kernel reads: rows [T, H, NUM_SPLITS] (and [.., HEAD_DIM])
        part = (token * (tl.num_programs(1) * G) + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=col_valid)
        tl.store(part_sum_ptr + part, l_i, mask=col_valid)
        tl.store(part_acc_ptr + part[None, :] * HEAD_DIM + dims[:, None], acc, mask=col_valid[None, :])


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor], query_start_loc: torch.Tensor,
           seq_lens: torch.Tensor, block_tables: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor],
           scale: float, sliding_window: int | None, soft_cap: float | None, splits: int,
           tile: tuple[int, int] | None = None, terms: int | None = None) -> None:
    """paged_attention's decode launch over an e4m3 cache with V by key (``applies``): ``out`` (splits == 1) or the
    split workspace (part_max, part_sum, part_acc) written. ``tile``: (keys a step, stages), DEFAULT_TILE if None;
    ``terms``: TERMS if None."""
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    block_n, stages = tile or DEFAULT_TILE
    assert block_n % 64 == 0, "wgmma's rows: keys a step, a multiple of 64"
    _fp8_decode_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, out, *workspace, query_start_loc, seq_lens, block_tables, *kv_scales,
        float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
        v_cache.stride(3), block_tables.stride(0),
        BLOCK_SIZE=block_size, G=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim, BLOCK_N=block_n, NUM_SPLITS=splits,
        USE_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap), TERMS=terms or TERMS, num_warps=4,
        num_stages=stages, **pdl.options(q.device))
