"""The decode-batch low-bit GEMM with the weight as the MMA's first operand: out^T = W @ x^T.

Why: quant_matmul's unpacked GEMM computes x @ W^T with the unpacked weight tile as ``tl.dot``'s second operand,
which Hopper's wgmma reads from shared memory, so every K step stores the bf16 tile there (a 16-bit store an
element) and waits for the wgmma before unpacking the next. The first operand may come from registers: swapped, the
weight is unpacked straight into them and x goes through shared memory instead, by asynchronous copies. That needs x
in the order the unpacked weights come out in:

- position-major (every layout): ``x[t, S * K / P + w]`` = input ``w * P + S`` (P elements a word), one dot per
  element position S of the words, each over that position's slice; x permuted by a copy a call (``T x K``);
- lane order (4-bit planes without a high plane, bf16 x: Q4_0, Q4_1, Q4_K, GPTQ/AWQ 4-bit): Marlin's unpack in
  bf16. A 32-bit lane takes two neighbouring weights (elements 2 j and 2 j + 1: one ``prmt`` puts byte j of the word
  in its low half and byte j of the word shifted by 4 in its high half), one lop3 puts both into the mantissas of
  128.0, an exact bf16x2 subtraction leaves the integers, one bf16x2 FMA applies the factors (rounded to bf16: errors
  a little above the float path's). The lanes come out in K order, so x is read as it is (until 2026-12-05 a lane
  held elements j and j + 4, one shift fewer a word, and x was permuted by a copy a call: ~3 us of a 64-row step's
  every GEMM on the H200, a torch kernel that also broke the chain of programmatic dependent launches).

Compiled for sm_90 on a CPU (2026-12-04, q4_k, 64 rows): ~5.5 loop instructions a weight element in lane order,
against ~9.9 for the unpacked GEMM; the lanes in K order add 8 a loop iteration (253 -> 261 at 64 rows, 248 -> 256
at 16; gptq4_g128 237 -> 246, 220 -> 228; `bench/sass_stats.py gemm-swapped --config 64,8,4,4`), with the same
layout conversions and barriers: not yet timed on the GPU against the copy of x they save. On the H200, lane order
with LANE_CONFIG is 20-30% faster than the unpacked GEMM at 2-32 rows, ~8-12% at 48-64 (quant_matmul.SWAPPED_MAX_ROWS:
where quant_gemm takes it by default);
position-major (the other layouts) is not timed and not a default. ``CVLLM_QUANT_GEMM=swapped|unpacked`` (read at
import) forces one for every layout and row count; ``quant_gemm(..., kernel="swapped")`` picks it per call.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import split_tickets
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_tiles import (
    add_splits,
    dot_into,
    group_words,
    kernel_tensors,
    load_words,
    quant_element,
    row_tile,
    split_k,
    upcast,
    word_factors,
)
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.kernels.split_tickets import last_split, summed_splits
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

# (BLOCK_N, BLOCK_W, num_warps, num_stages) position-major, by low-plane bits: a K step of 128 elements (2-bit: 256,
# as a position's dot needs 16 words); compiled for sm_90, every test layout fits at 2-128 rows (76-209 KB of shared
# memory); not timed
SWAPPED_CONFIGS = {2: (128, 16, 4, 3), 4: (128, 16, 4, 4), 8: (128, 32, 4, 4)}
# lane order: the best of seven tiles at 2-48 rows on the H200, q4_k and gptq4_g128 (narrower BLOCK_N and 2 warps were
# 1.5-2.5x slower; bench/results/2026-12-04-h200-gemm_swapped_probe-tiles-5c9bebb.json)
LANE_CONFIG = (64, 8, 4, 4)
# CVLLM_SWAPPED_OPERAND_LANES (read at import): each thread unpacks only the lanes its wgmma operand registers hold
# (``_lane``), no shared-memory round trip of the unpacked tile. "1": always; "auto": GPTQ/AWQ (the layouts of float
# activations) from OPERAND_LANES_FROM_ROWS rows on, where the probe gained (H100, session 32, us a Llama-3-8B layer's
# four products, tile lanes -> operand lanes: gptq4_g128 32 rows 126.1 -> 116.9, 64 rows 148.0 -> 129.7; 16 rows
# 111.8 -> 120.6 and q4_k 157.0 -> 166.0 at 64 rows lost); unset or "0": never (the default until 64 streams are
# timed end to end with "auto": `run_all.sh quant64` with QUANT64_CASES="gptq gptq-lanes")
_OPERAND_LANES_ENV = os.environ.get("CVLLM_SWAPPED_OPERAND_LANES", "0")
OPERAND_LANES: bool | str = "auto" if _OPERAND_LANES_ENV == "auto" else _OPERAND_LANES_ENV == "1"
OPERAND_LANES_FROM_ROWS = 32


def operand_lanes(layout: QuantLayout, rows: int) -> bool:
    """Whether a lane-order product of ``rows`` rows by a weight in ``layout`` unpacks the operand's lanes only
    (OPERAND_LANES)."""
    if OPERAND_LANES == "auto":
        return not layout.int8_activations and rows >= OPERAND_LANES_FROM_ROWS
    return bool(OPERAND_LANES)

# lane j: byte j of the word in the low half, byte j of the word shifted by 4 in the high half (one prmt: selector
# nibbles j, j, 4 + j, 4 + j), so that the mask leaves element 2 j below 128.0's mantissa and element 2 j + 1 above
_LANE = ("prmt.b32 t, $4, h, %d; lop3.b32 t, t, 0x000F000F, c, 0xEA; sub.rn.bf16x2 t, t, c; "
         "fma.rn.bf16x2 $%d, t, s2, o2; ")
LANES_ASM = tl.constexpr(
    "{ .reg .b32 c, s2, o2, t, h; .reg .b16 sb, ob; mov.b32 c, 0x43004300; cvt.rn.bf16.f32 sb, $5; "
    "cvt.rn.bf16.f32 ob, $6; mov.b32 s2, {sb, sb}; mov.b32 o2, {ob, ob}; shr.b32 h, $4, 4; "
    + "".join(_LANE % (j | j << 4 | (4 + j) << 8 | (4 + j) << 12, j) for j in range(4)) + "}")


# lane p of a word (elements 2 p and 2 p + 1, prmt selector p * 0x1111 + 0x4400) from its word, the word shifted by
# 4, and the packed bf16x2 factors
LANE_ASM = tl.constexpr(
    "{ .reg .b32 c, t; mov.b32 c, 0x43004300; prmt.b32 t, $1, $2, $3; lop3.b32 t, t, 0x000F000F, c, 0xEA; "
    "sub.rn.bf16x2 t, t, c; fma.rn.bf16x2 $0, t, $4, $5; }")


@triton.jit
def _pack2(lo, hi):
    """Two bf16 tensors -> int32 lanes holding ``lo`` in the low half and ``hi`` in the high one."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _lanes(word, scale, offset, ASM: tl.constexpr):
    """A 4-bit word's eight bf16 ``q * scale + offset`` as four int32 lanes, lane j elements 2 j (low half) and
    2 j + 1 (high half). The interpreter (no inline PTX) spells the same values out."""
    if ASM:
        return tl.inline_asm_elementwise(LANES_ASM, "=r,=r,=r,=r,r,r,r", [word, scale, offset],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        s = scale.to(tl.bfloat16).to(tl.float32)
        o = offset.to(tl.bfloat16).to(tl.float32)
        lane0 = _pack2((((word >> 0) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16),
                       (((word >> 4) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16))
        lane1 = _pack2((((word >> 8) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16),
                       (((word >> 12) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16))
        lane2 = _pack2((((word >> 16) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16),
                       (((word >> 20) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16))
        lane3 = _pack2((((word >> 24) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16),
                       (((word >> 28) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16))
        return lane0, lane1, lane2, lane3


@triton.jit
def _lane(word, pair, scale2, offset2, ASM: tl.constexpr):
    """Lane ``pair`` (0-3) of 4-bit words: elements 2 pair (low half) and 2 pair + 1 (high half) as bf16
    ``q * scale + offset`` in an int32, the factors given as bf16x2 pairs (``_pack2``); arguments of one shape."""
    if ASM:
        return tl.inline_asm_elementwise(LANE_ASM, "=r,r,r,r,r,r",
                                         [word, word >> 4, pair * 0x1111 + 0x4400, scale2, offset2],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = (scale2 & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        o = (offset2 & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        return _pack2((((word >> (8 * pair)) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16),
                      (((word >> (8 * pair + 4)) & 0xF).to(tl.float32) * s + o).to(tl.bfloat16))


@triton.jit
def _first_words(v, BLOCK_N: tl.constexpr, G: tl.constexpr, GW: tl.constexpr):
    """[BLOCK_N, G * GW] -> [BLOCK_N, G]: each group's first word, by halving splits (GW a power of two up to 16).
    The factors are taken per word and then selected, not loaded per group: loads of [BLOCK_N, G] are too small for
    the pipeline's asynchronous copies and came in the loop as synchronous ones; the words' loads left unused here
    are compiled away."""
    tl.static_assert(GW <= 16 and (GW & (GW - 1)) == 0, "a group's words: a power of two up to 16")
    if GW >= 2:
        v = tl.split(tl.reshape(v, (BLOCK_N, G * GW // 2, 2)))[0]
    if GW >= 4:
        v = tl.split(tl.reshape(v, (BLOCK_N, G * GW // 4, 2)))[0]
    if GW >= 8:
        v = tl.split(tl.reshape(v, (BLOCK_N, G * GW // 8, 2)))[0]
    if GW >= 16:
        v = tl.split(tl.reshape(v, (BLOCK_N, G * GW // 16, 2)))[0]
    return v


@triton.jit
def _lanes_to_bf16(lanes):
    """int32 lanes [...] -> bf16 [..., 2], element m the lane's half m. Not inline PTX with ``pack=2``: that hands
    an instance two consecutive registers of the thread, which in the compiled layout were not always the two
    copies of one lane (the GPU test failed for every lane-order layout while the interpreter passed)."""
    low = (lanes & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    high = (lanes >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.join(low, high)


@triton.jit(do_not_specialize=["T"])
def _gemm_swapped_kernel(x_ptr, out_ptr, partial_ptr, counters_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, T,
                         N, K, stride_xt, stride_ot, SPLIT_WORDS, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr,
                         SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr,
                         B_MODE: tl.constexpr, B_CONST: tl.constexpr, HAS_M: tl.constexpr, FLOAT8: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr,
                         UPCAST: tl.constexpr, LANES: tl.constexpr, ASM: tl.constexpr, GROUP_WORDS: tl.constexpr,
                         USE_PDL: tl.constexpr, FUSED_SUM: tl.constexpr = False, SPLITS: tl.constexpr = 1):
    """out^T tile [BLOCK_N, BLOCK_M] += W tile [BLOCK_N, BLOCK_W words] @ x^T over K steps of BLOCK_W words: LANES,
    one dot a step in lane order (x as it is; 1: a thread unpacks all four lanes of its words, 2: the lanes its wgmma
    operand registers hold); else one per element position (x permuted, module docstring). Split
    over K like the unpacked GEMM: with more than one split, each stores its float32 partial sums in [splits, T, N]
    at ``partial_ptr``, added by sum_splits_kernel or, FUSED_SUM (SPLITS of them), by the split that finishes last
    (split_tickets.py; ``counters_ptr``: its tickets, one a tile)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ts = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = ts < T
    words_in_k = K // PER_WORD
    start = tl.program_id(2) * SPLIT_WORDS
    num_words = tl.minimum(words_in_k, start + SPLIT_WORDS)
    x_cols = x_ptr + ts.to(tl.int64)[None, :] * stride_xt
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for w0 in range(start, num_words, BLOCK_W):
        words = w0 + tl.arange(0, BLOCK_W)
        word_ok = words < num_words
        ok = col_ok[:, None] & word_ok[None, :]
        first = (words * PER_WORD)[None, :]
        low, high = load_words(low_ptr, high_ptr, words[None, :], cols[:, None], ok, N, LOW_BITS, HIGH_BITS)
        scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, first, cols[:, None], ok, N, SCALE_GROUP,
                                      SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
        if LANES == 2:
            # a group's factors once, as bf16x2; [N, groups, group's words, lane]: Triton lays this out as the
            # wgmma's register operand (a thread holds lane p = its lane id % 4), no layout conversion
            G: tl.constexpr = BLOCK_W // GROUP_WORDS
            s2 = _first_words(scale, BLOCK_N, G, GROUP_WORDS).to(tl.bfloat16)
            o2 = _first_words(offset, BLOCK_N, G, GROUP_WORDS).to(tl.bfloat16)
            s2 = _pack2(s2, s2)
            o2 = _pack2(o2, o2)
            shape: tl.constexpr = (BLOCK_N, G, GROUP_WORDS, 4)
            lanes = _lane(tl.broadcast_to(tl.reshape(low, (BLOCK_N, G, GROUP_WORDS))[:, :, :, None], shape),
                          tl.broadcast_to(tl.arange(0, 4)[None, None, None, :], shape),
                          tl.broadcast_to(s2[:, :, None, None], shape), tl.broadcast_to(o2[:, :, None, None], shape),
                          ASM)
        elif LANES:
            lane0, lane1, lane2, lane3 = _lanes(low, scale, offset, ASM)
            lanes = tl.join(tl.join(lane0, lane2), tl.join(lane1, lane3))   # [N, W, c, d]: lane 2 c + d
        if LANES:
            # [N, W, ..., m]: element m of each lane, in K order (x read as it is)
            w = tl.reshape(_lanes_to_bf16(lanes), (BLOCK_N, BLOCK_W * 8))
            ks = w0 * 8 + tl.arange(0, BLOCK_W * 8)
            x = tl.load(x_cols + ks[:, None], mask=(ks < num_words * 8)[:, None] & t_ok[None, :], other=0.0)
            acc = dot_into(w, x, acc, IEEE, UPCAST)
        else:
            for S in tl.static_range(PER_WORD):
                x = tl.load(x_cols + (S * words_in_k + words)[:, None], mask=word_ok[:, None] & t_ok[None, :],
                            other=0.0)
                w = (quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset).to(x.dtype)
                acc = dot_into(w, x, acc, IEEE, UPCAST)
    ok = col_ok[:, None] & t_ok[None, :]
    out_ptrs = out_ptr + ts.to(tl.int64)[None, :] * stride_ot + cols[:, None]
    splits = tl.num_programs(2)
    if splits > 1:
        at = ts[None, :] * N + cols[:, None]   # [BLOCK_N, BLOCK_M] in a split's [T, N]
        tl.store(partial_ptr + tl.program_id(2).to(tl.int64) * T * N + at, acc, mask=ok)
        if FUSED_SUM:
            if last_split(counters_ptr, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLITS):
                total = summed_splits(partial_ptr + at, ok, T * N, SPLITS, 2)
                tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def in_lanes(layout: QuantLayout, dtype: torch.dtype) -> bool:
    """Whether a product of a weight in ``layout`` with x of ``dtype`` takes the lane-order unpack."""
    return layout.low_bits == 4 and not layout.high_bits and not layout.float8 and dtype == torch.bfloat16


def permuted(x: torch.Tensor, weight: QuantWeight, lanes: bool) -> torch.Tensor:
    """x [T, K] in the kernel's order: x itself in lane order (lane j holds a word's elements 2 j and 2 j + 1: the
    lanes come out in K order), else position-major (a copy)."""
    t, k = x.shape
    if lanes:
        return x
    per_word = 32 // weight.layout.low_bits
    return x.view(t, k // per_word, per_word).transpose(1, 2).reshape(t, k)


def quant_gemm_swapped(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
                       splits: int | None = None, fused_sums: bool | None = None) -> None:
    """out = x @ weight.T for x [T, K] (last dimension contiguous) and out [T, N] (last dimension contiguous).
    ``config``: (BLOCK_N, BLOCK_W, num_warps, num_stages[, BLOCK_M]). ``fused_sums``: K splits added in the launch
    (None: split_tickets.SWAPPED_ENABLED; 4-bit lane layouts only)."""
    lay = weight.layout
    t, n, k = x.shape[0], weight.out_features, weight.in_features
    lanes = in_lanes(lay, x.dtype)
    xp = permuted(x, weight, lanes)
    block_n, block_w, warps, stages, *block_m = config or (LANE_CONFIG if lanes else SWAPPED_CONFIGS[lay.low_bits])
    block_m = block_m[0] if block_m else row_tile(t)
    assert block_w >= (2 if lanes else 16), f"BLOCK_W {block_w}: a dot needs a K of 16"
    grid = (cdiv(n, block_n), cdiv(t, block_m))
    splits, split_words = split_k(grid[0] * grid[1], k, lay.low_bits, block_w, x.device, splits)
    partials = out if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    # (lanes only: the position-by-position tiles of the high-plane layouts are at 244 registers at 64 rows already,
    # and the in-launch sum spills there)
    tickets = (split_tickets.launch_tickets(x.device, grid[0] * grid[1], splits, fused_sums,
                                           split_tickets.SWAPPED_ENABLED) if lanes else None)
    _gemm_swapped_kernel[(*grid, splits)](
        xp, out, partials, partials if tickets is None else tickets, *kernel_tensors(weight), t, n, k,
        xp.stride(0), out.stride(0), split_words, **lay.kernel_args(), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_W=block_w, IEEE=x.dtype == torch.float32, UPCAST=upcast(x.dtype),
        LANES=(2 if operand_lanes(lay, t) else 1) if lanes else 0,
        ASM=not triton.knobs.runtime.interpret, GROUP_WORDS=group_words(lay, block_w), num_warps=warps,
        num_stages=stages, FUSED_SUM=tickets is not None, SPLITS=splits if tickets is not None else 1,
        **pdl_options(x.device))
    if splits > 1 and tickets is None:
        add_splits(partials, out, splits, n)
