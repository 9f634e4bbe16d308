"""Paged attention over a mixed varlen batch (prefill chunks and decodes) in one Triton launch.

Work split. One program owns one KV head of one tile of one sequence's queries. The rows of its
tile are (query token x the G = H / Hkv query heads sharing that KV head), so each K/V block is
loaded once per KV head and reused by all G heads (GQA). Sequence s owns the flat tiles from
``query_start_loc[s] // BLOCK_Q + s`` on; a program finds its sequence by binary search, and the
grid, ``cdiv(T, BLOCK_Q) + num_seqs - 1`` tiles, depends on the batch shape only. When every
sequence decodes one token (``max_query_len == 1``) tile i is simply sequence i.

Split-KV. A long decode leaves most SMs idle with one program per (sequence, KV head); a third
grid axis then cuts each tile's key range into NUM_SPLITS slices, each program writes an
unnormalised partial (row max, row sum, accumulator) to a workspace, and a small kernel combines
them (attention_splits.py).
Slices are cut on the device from the tile's own key range, so the grid never depends on context
length and nothing is read back to the host: the decode path can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu, pdl, quant_gemv_int8
from cvllm_cuda.kernels.attention_splits import combine_splits
from cvllm_cuda.kernels.attention_step import attend_keys
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2
from cvllm_cuda.kernels.tuned_configs import TUNED, TUNED_SPARSE_DECODE

MAX_SPLITS = 16
MAX_SPLIT_QUERY_LEN = 8   # queries per sequence up to which keys are split (default_num_splits)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    block_m: int      # rows of a tile: query tokens x query heads of one KV head (>= G; >= 16 for tl.dot)
    block_n: int      # keys per step of the inner loop
    num_warps: int
    num_stages: int
    # registers a thread may use (Triton's maxnreg), None: the compiler's choice. The FP8-cache decode tile compiled
    # to 208 a thread on sm_90 with V by dim (bf16: 234), so 4 programs of 2 warps fit an SM; 168 fits 6 (24 B
    # spilled): more e4m3 key tiles in flight. With V by key (the engine's layout since 2026-12-05) it holds 192
    # uncapped and 168 without spills; the cap's gain is not re-measured for it. Applied only to launches of more
    # programs than UNCAPPED_WAVE an SM (paged_attention): a launch that fits one wave uncapped only pays the spills
    max_registers: int | None = None


# Programs an SM of the uncapped decode tile (4 at 208 registers a thread, 2 warps). Measured on the H200 (FP8 cache,
# bench/results/2026-12-04-h200-tune_attention-fp8-caps-5c9bebb.json), 168 registers against none: 256 x 1k 206.8
# vs 232.8 us, 256 x 2k 398.7 vs 448.1 (2,048 programs); 64 x 1.5k 106.6 vs 91.9 (512 programs: one wave either way)
UNCAPPED_WAVE = 4


# Autotuned configs committed per GPU (bench/tune_attention.py writes them):
# {torch.cuda.get_device_name(): {(head_dim, dtype, decode): (block_m, block_n, num_warps, num_stages)}},
# dtype spelled as in torch ("bfloat16"), decode meaning max_query_len == 1; attention_config() falls back
# to the defaults below for anything missing.
TUNED_CONFIGS: dict[str, dict[tuple[int, str, bool], AttentionConfig]] = {
    gpu: {key: AttentionConfig(*value) for key, value in entries.items()} for gpu, entries in TUNED.items()}
# decodes with no more programs than SMs (tuned_configs.TUNED_SPARSE_DECODE): {gpu: {(head_dim, dtype): config}}
SPARSE_DECODE_CONFIGS: dict[str, dict[tuple[int, str], AttentionConfig]] = {
    gpu: {key: AttentionConfig(*value) for key, value in entries.items()}
    for gpu, entries in TUNED_SPARSE_DECODE.items()}


def attention_config(head_dim: int, dtype: torch.dtype, decode: bool, device: torch.device,
                     sparse: bool = False, fp8_cache: bool = False) -> AttentionConfig:
    """Tile sizes for this head dim and dtype: a tuned entry for this GPU if committed, else a default.
    ``sparse``: a decode launch of at most one program per SM, which has its own tuned entries (where none is
    committed it takes the decode one). ``fp8_cache``: an e4m3 cache, whose tuned entries are spelled
    "float8_e4m3fn" (where none is committed it takes the queries' dtype's).

    Defaults, from a sweep on an H200 (bf16, 32 query / 8 KV heads): decodes are memory-bound and 64-key
    steps reach ~4 TB/s; 16-bit prefill tiles of 64 x 64 for D <= 128 and 128 x 64 with 8 warps for
    D = 256. fp32 tiles hold twice the bytes per element, so they get smaller tiles.
    """
    dtype_name = str(dtype).removeprefix("torch.")
    tuned = gpu.tuned_entry(SPARSE_DECODE_CONFIGS, device, (head_dim, dtype_name)) if sparse and decode else None
    if tuned is None and fp8_cache:
        tuned = gpu.tuned_entry(TUNED_CONFIGS, device, (head_dim, "float8_e4m3fn", decode))
    if tuned is None:
        tuned = gpu.tuned_entry(TUNED_CONFIGS, device, (head_dim, dtype_name, decode))
    if tuned is not None:
        return tuned
    fp32 = dtype == torch.float32
    if decode:
        return AttentionConfig(block_m=16, block_n=32 if fp32 or head_dim > 128 else 64, num_warps=4, num_stages=2)
    if fp32:
        return AttentionConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def without_cap_in_one_wave(config: AttentionConfig, programs: int, device: torch.device) -> AttentionConfig:
    """``config`` without its register cap where a launch of ``programs`` fits one wave of the uncapped tile."""
    if config.max_registers and device.type == "cuda" and programs <= UNCAPPED_WAVE * gpu.num_sms(
            gpu.device_index(device)):
        return replace(config, max_registers=None)
    return config


def default_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, device: torch.device) -> int:
    """Split decodes' keys only when the batch alone cannot fill the GPU: aim at two programs per SM.

    A plain function of the batch shape and the SM count, never of sequence lengths, so the choice made
    when a CUDA graph is captured stays right for any context. Batches of a few queries per sequence (a
    speculative verify step: a token and its drafts, one tile per sequence) split as decodes do; longer
    prefill batches are not split: their tiles already fill the GPU and their workspace would be large.
    """
    programs = num_seqs * num_kv_heads
    if max_query_len > MAX_SPLIT_QUERY_LEN or device.type != "cuda" or programs == 0:
        return 1
    sms = gpu.num_sms(gpu.device_index(device))
    if programs >= sms:
        return 1
    return min(MAX_SPLITS, next_power_of_2(cdiv(2 * sms, programs)))


def is_sparse_decode(num_seqs: int, num_kv_heads: int, num_splits: int, device: torch.device) -> bool:
    """A decode launch of no more programs than SMs (batch 1: 8 KV heads x 16 slices), which takes the
    sparse-decode tile (tuned_configs.TUNED_SPARSE_DECODE)."""
    return device.type == "cuda" and num_seqs * num_kv_heads * num_splits <= gpu.num_sms(gpu.device_index(device))


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence s whose first tile, query_start_loc[s] // BLOCK_Q + s, is <= tile.

    That start is increasing in s and leaves each sequence at least cdiv(q_len, BLOCK_Q) tiles.
    """
    lo = tl.zeros([], tl.int32)
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(mid_first_tile <= tile, mid, lo)
        hi = tl.where(mid_first_tile <= tile, hi, mid - 1)
    return lo


# num_seqs and the block-table width change from step to step: Triton's default specialisation of integer
# arguments (== 1, divisible by 16) would compile new variants mid-serving, ~0.5 s each
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, scale, soft_cap, sliding_window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr, USE_PDL: tl.constexpr, VALUES_BY_KEY: tl.constexpr = False,
):
    """VALUES_BY_KEY: V's keys contiguous within a page (kv_cache.empty_value_cache; attention_step.py)."""
    wait_for_previous_kernel(USE_PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # FP8: e4m3 keys and values, the head's K scale folded into the softmax scale, its V scale into the output
    # (read here, not after the key loop: there it was one more round trip at the end of every program); with 16-bit
    # queries the products are taken in float16 (below)
    v_scale = 1.0
    if FP8:
        scale = scale * tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    if DECODE_ONLY:
        seq = tile
        q_start = tl.load(query_start_loc_ptr + seq)
        q_tile = 0
    else:
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_tile = tile - (q_start // BLOCK_Q + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # a spare tile: its sequence has fewer queries
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    q_index = q_tile * BLOCK_Q + rows // G  # query token within its sequence
    head = kv_head * G + rows % G
    row_valid = (rows < BLOCK_Q * G) & (q_index < q_len)
    q_pos = context_len + q_index  # absolute position: the causal and window masks compare keys with it
    token = (q_start + q_index).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM  # BLOCK_D is HEAD_DIM rounded up to a power of two (D = 80, 96)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if FP8 and q.dtype != tl.float32:
        # e4m3 -> float16 is exact and one conversion (to bfloat16: two), and bf16 q is exact in float16 below 65504
        # (H200, 256 sequences x 1k keys: 258 -> 232 us; 64 x 1.5k: 146 -> 92; tune_attention.py --kv-dtype fp8)
        q = q.to(tl.float16)

    # Keys any row of the tile may see: up to its last query, back one window from its first.
    first_pos = context_len + q_tile * BLOCK_Q
    kv_end = tl.minimum(first_pos + BLOCK_Q, seq_len)
    kv_begin = first_pos * 0
    if USE_WINDOW:
        kv_begin = tl.maximum(first_pos - sliding_window + 1, 0)
        if VALUES_BY_KEY:   # steps start on a multiple of BLOCK_N (attention_step.py); the window masks the rest
            kv_begin = kv_begin // BLOCK_N * BLOCK_N
    # This program's slice: a contiguous run of BLOCK_N-key steps (all of them when NUM_SPLITS == 1).
    steps_per_split = tl.cdiv(tl.cdiv(kv_end - kv_begin, BLOCK_N), NUM_SPLITS)
    split_begin = kv_begin + split * steps_per_split * BLOCK_N
    split_end = tl.minimum(kv_end, split_begin + steps_per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if VALUES_BY_KEY:
        # the steps whose keys are all the sequence's without load masks, then (at most) one masked step
        # (attention_step.py: values by key are zeroed past the sequence a byte at a time)
        whole_steps = tl.minimum(tl.cdiv(split_end - split_begin, BLOCK_N), (seq_len - split_begin) // BLOCK_N)
        clean_end = split_begin + tl.maximum(whole_steps, 0) * BLOCK_N
        for start in range(split_begin, clean_end, BLOCK_N):
            acc, m_i, l_i = attend_keys(
                acc, m_i, l_i, q, tl.multiple_of(start, BLOCK_N), split_end, q_pos, table, k_cache_ptr, v_cache_ptr,
                kv_head, dims, dim_valid, scale, soft_cap, sliding_window, stride_cb, stride_cs, stride_ch, stride_vb,
                stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, FP8,
                True, False)
        if clean_end < split_end:
            acc, m_i, l_i = attend_keys(
                acc, m_i, l_i, q, tl.multiple_of(clean_end, BLOCK_N), split_end, q_pos, table, k_cache_ptr,
                v_cache_ptr, kv_head, dims, dim_valid, scale, soft_cap, sliding_window, stride_cb, stride_cs,
                stride_ch, stride_vb, stride_vh, stride_vd, BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFT_CAP,
                DOT_PRECISION, FP8, True, True)
    else:
        for start in range(split_begin, split_end, BLOCK_N):
            acc, m_i, l_i = attend_keys(
                acc, m_i, l_i, q, start, split_end, q_pos, table, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_valid,
                scale, soft_cap, sliding_window, stride_cb, stride_cs, stride_ch, stride_vb, stride_vh, stride_vd,
                BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFT_CAP, DOT_PRECISION, FP8, False, True)
    if FP8:
        acc = acc * v_scale

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l == 0 only for a row that sees no key at all
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # workspace rows [T, H, NUM_SPLITS] (and [.., HEAD_DIM]); an empty slice writes (-inf, 0, 0)
        part = (token * (tl.num_programs(1) * G) + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                    sliding_window: int | None, soft_cap: float | None, out: torch.Tensor | None = None, *,
                    num_splits: int | None = None, config: AttentionConfig | None = None,
                    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None, feeds=None) -> torch.Tensor:
    """Attention of varlen queries ``q [T, H, D]`` over the paged caches ``[num_blocks, block_size, Hkv, D]``.

    Sequence i's queries are rows ``query_start_loc[i]:query_start_loc[i + 1]`` at positions
    ``seq_lens[i] - q_len ... seq_lens[i] - 1``; its keys are at ``block_tables[i]`` (entries past its last
    block are never read). ``max_query_len`` must be >= the longest q_len (it picks tile shapes; 1 selects
    the decode path). ``num_splits`` forces the split-KV path (rounded up to a power of two); by default
    ``default_num_splits``. ``config`` overrides the tile sizes of ``attention_config`` (tuning). FP8 caches
    (float8_e4m3fn) take ``kv_scales``: the K and V scales per KV head (float32 [Hkv]) the stored values are
    multiplied by; their V cache may be laid out by key (``kv_cache.empty_value_cache``: a page's keys contiguous
    for each dimension, what the engine allocates on CUDA). ``feeds``: the linear layer the output goes to next
    (Attention.feeds): where that is a low-bit GEMV on int8 activations, the split-KV path's combining kernel makes
    the output's int8 form too and hands it over (quant_gemv_int8.hand_over; a decode step's few rows); elsewhere
    none is made, and the GEMV rounds the output itself.
    Launches without reading anything back to the host.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim, (q.shape, k_cache.shape)
    assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    assert (q.dtype == k_cache.dtype or fp8) and v_cache.dtype == k_cache.dtype, (q.dtype, k_cache.dtype)
    assert fp8 == (kv_scales is not None), "an FP8 cache needs its scales (and only an FP8 cache)"
    # V laid out like K, or (an FP8 cache: kv_cache.empty_value_cache) a page's keys contiguous for each dimension
    values_by_key = v_cache.stride(1) == 1 and block_size > 1
    assert fp8 or not values_by_key, "values by key are an FP8 cache's layout"
    assert values_by_key or v_cache.stride() == k_cache.stride(), "V is laid out as K is, or by key"
    # (the loads copy runs of a page's keys 16 bytes at a time: every other stride a multiple of the page)
    assert not values_by_key or all(v_cache.stride(d) % block_size == 0 for d in (0, 2, 3)), v_cache.stride()
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "q and the K cache need a contiguous last dim"
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert query_start_loc.stride(0) == 1 and seq_lens.stride(0) == 1 and block_tables.stride(1) == 1
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    decode = max_query_len == 1
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, max_query_len, q.device)
    splits = min(MAX_SPLITS, next_power_of_2(splits))
    if config is None:
        sparse = decode and is_sparse_decode(num_seqs, num_kv_heads, splits, q.device)
        config = attention_config(head_dim, q.dtype, decode, q.device, sparse, fp8_cache=fp8)
        config = without_cap_in_one_wave(config, num_seqs * num_kv_heads * splits, q.device)
    # query tokens per tile: a power of two, so short prefill chunks share a handful of compiled variants
    block_q = max(1, min(config.block_m // group, next_power_of_2(max_query_len)))
    block_m = max(16, next_power_of_2(block_q * group))
    tiles = num_seqs if decode else cdiv(num_tokens, block_q) + num_seqs - 1
    block_d = next_power_of_2(head_dim)

    if splits > 1:
        part_max = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # never touched: the kernel writes `out` directly
    launch = pdl.options(q.device)
    combined_int8 = splits > 1 and head_dim % 32 == 0 and out.is_contiguous()
    int8_bits, made = quant_gemv_int8.output_form(out, feeds if combined_int8 else None, num_tokens)
    _attention_kernel[(tiles, num_kv_heads, splits)](
        q, k_cache, v_cache, out, part_max, part_sum, part_acc,
        query_start_loc, seq_lens, block_tables, *(kv_scales or (seq_lens, seq_lens)),
        num_seqs, float(scale), float(soft_cap or 0.0), int(sliding_window or 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(2),
        v_cache.stride(3), block_tables.stride(0),
        BLOCK_SIZE=block_size, G=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=config.block_n,
        NUM_SPLITS=splits, DECODE_ONLY=decode, USE_WINDOW=bool(sliding_window), USE_SOFT_CAP=bool(soft_cap),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
        VALUES_BY_KEY=values_by_key,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch,
        **({"maxnreg": config.max_registers} if config.max_registers else {}),
    )
    if splits > 1:
        combine_splits(out, part_max, part_sum, part_acc, made, int8_bits)
    if int8_bits:
        quant_gemv_int8.hand_over(out, feeds, int8_bits, made)
    return out
