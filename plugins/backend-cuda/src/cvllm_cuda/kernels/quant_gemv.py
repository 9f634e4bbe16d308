"""The batch-1 low-bit GEMV on float activations (``quant_matmul`` calls it for one row of x; layouts that allow it
take quant_gemv_int8.py instead).

Each program owns BLOCK_N output features and walks K in tiles of quant_tiles.py, summing ``q * x`` per word and
applying the scale group's factors once (``scale * sum(q x) + offset * sum(x)``); one reduction at the end. When
the output features alone make too few programs to fill the GPU (a 4096-row weight is 128 tiles of 32), K is split
over programs too and a second small kernel adds the float32 partial sums (summing them in the last split's own
launch instead measured slower at batch 1 on an H100, 2026-12-05, and was removed).

Measured on the H200 (bench/quant_matmul_sweep.py, docs/benchmarks.md): its arithmetic (about four instructions per
weight) is ~40% of its time; a Q4_K Llama-3-8B decodes ~1.1x bf16 with it, ~1.4x with the int8-activation GEMV.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu, quant_tiles
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_tiles import (
    add_splits,
    even_tiles,
    group_words,
    groups_in_thread,
    kernel_tensors,
    load_masked,
    split_k,
    word_factors,
)
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.kernels.tuned_matmul import TUNED_QUANT_GEMV, quant_gemv_key
from cvllm_cuda.quant_planes import QuantWeight

# (BLOCK_N, BLOCK_W, num_warps[, stages]) by low-plane bits, and how many programs per SM K is split for, from
# bench/quant_gemv_stack.py (a stack of Llama-3-8B layers in one CUDA graph, H200, 2026-12-03): GPTQ-4bit g128
# 68.1 us a layer (85.7 with (32, 32, 4) at 4 programs per SM), Q6_K 100.1 (its best, (32, 64, 8), 94.9)
GEMV_CONFIGS = {2: (32, 32, 4), 4: (32, 32, 4, 3), 8: (32, 32, 4)}
GEMV_PROGRAMS_PER_SM = 8


# the bits of float 1.0, passed as an argument: as a constant, ptxas splits ``(w & MASK) | 0x3F800000`` into two
# instructions (a SASS LOP3 takes one immediate); from a register it is one
ONE_BITS = 0x3F800000


@triton.jit
def _and_or(word, MASK: tl.constexpr, one_bits):
    """``(word & MASK) | one_bits`` in one ``lop3``."""
    return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                     [word, tl.full(word.shape, MASK, tl.int32), one_bits + tl.zeros_like(word)],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _unit(low, high_at, S: tl.constexpr, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, FLOAT8: tl.constexpr,
          INTERPRET: tl.constexpr, one_bits):
    """float32 ``1 + q / 2**bits`` for element S of each word: q's bits moved to the top of a float's mantissa under
    the exponent of 1.0 (one shift and one masked or: no conversion, no subtraction; exact), or the FP8 value
    (FLOAT8). ``high_at``: the high-plane word shifted so that element 0's high bits are its lowest."""
    if FLOAT8:
        return ((low >> (S * 8)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    top: tl.constexpr = 23 - LOW_BITS - HIGH_BITS       # where q's lowest bit goes
    shift: tl.constexpr = top - S * LOW_BITS
    if shift >= 0:
        moved = low << shift
    else:
        moved = low >> -shift                           # arithmetic shift: the mask drops the copied sign bits
    if HIGH_BITS > 0 or INTERPRET:
        v = (moved & (((1 << LOW_BITS) - 1) << top)) | 0x3F800000
    else:
        v = _and_or(moved, ((1 << LOW_BITS) - 1) << top, one_bits)
    if HIGH_BITS > 0:
        high_shift: tl.constexpr = top + LOW_BITS - S * HIGH_BITS
        if high_shift >= 0:
            high = high_at << high_shift
        else:
            high = high_at >> -high_shift
        v = v | (high & (((1 << HIGH_BITS) - 1) << (top + LOW_BITS)))
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _float_weight_tile(w0, low_ptrs, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, tile_words, group_first, cols3,
                       num_words, N, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                       SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                       HAS_M: tl.constexpr, EVEN: tl.constexpr):
    """The weight side of _gemv_kernel's K step at word ``w0``: its low words, the high plane's bits for them (or
    the low words again), and its groups' factors [GROUPS, 1, BLOCK_N]. Nothing of x."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    words = w0 + tile_words
    gwords = (w0 + group_first)[:, None, None]
    if EVEN:
        ok = None
        group_ok = None
    else:
        ok = (words < num_words) & (cols3 < N)
        group_ok = (gwords < num_words) & (cols3 < N)
    low = load_masked(low_ptrs, ok, 0)
    high_at = low
    if HIGH_BITS > 0:
        first = words * PER_WORD
        high = load_masked(high_ptr + first // (32 // HIGH_BITS) * N + cols3, ok, 0)
        high_at = high >> (first % (32 // HIGH_BITS) * HIGH_BITS)
    # each group's factors, at its first word (a word never straddles a scale group), loaded [GROUPS, 1, BLOCK_N]
    # in the tile's layout (no shared-memory round trip)
    scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, gwords * PER_WORD, cols3, group_ok, N, SCALE_GROUP,
                                  SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
    return low, high_at, scale, offset


@triton.jit
def _float_tile_step(acc, low, high_at, scale, offset, x_ptrs, w0, tile_words, num_words, one_bits,
                     LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, FLOAT8: tl.constexpr, GROUP_SUM: tl.constexpr,
                     EVEN: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc`` plus the K step at word ``w0`` (its weights from _float_weight_tile) times x."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    UNIT: tl.constexpr = 1.0 if FLOAT8 else float(1 << (LOW_BITS + HIGH_BITS))
    word_ok = None if EVEN else (w0 + tile_words) < num_words
    part = tl.zeros(low.shape, dtype=tl.float32)
    x_sum = tl.zeros((low.shape[0], low.shape[1], 1), dtype=tl.float32)
    for S in tl.static_range(PER_WORD):
        x = load_masked(x_ptrs + S, word_ok, 0.0).to(tl.float32)
        part += _unit(low, high_at, S, LOW_BITS, HIGH_BITS, FLOAT8, INTERPRET, one_bits) * x
        x_sum += x
    # part = sum(x) + sum(q x) / UNIT per word (FP8: sum(q x)), summed over the group's words
    if GROUP_SUM:
        part = tl.sum(part, axis=1, keep_dims=True)
        x_sum = tl.sum(x_sum, axis=1, keep_dims=True)
    scaled = scale * UNIT
    if FLOAT8:
        acc += part * scaled + offset * x_sum
    else:
        acc += part * scaled + (offset - scaled) * x_sum
    return acc


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, partial_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K,
                 SPLIT_WORDS, one_bits,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 GROUP_WORDS: tl.constexpr, GROUP_SUM: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
                 INTERPRET: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr = False):
    """Program (i, j) sums words j * SPLIT_WORDS .. (j + 1) * SPLIT_WORDS of output features i * BLOCK_N ...; with
    more than one split, each stores its partial sums in the float32 [splits, N] at ``partial_ptr``, added by
    ``sum_splits_kernel``.

    A tile is [BLOCK_W // GROUP_WORDS, GROUP_WORDS, BLOCK_N] words: GROUP_WORDS words share their factors (one
    scale group, or a part of one), loaded once per group and column. Per element: a shift, an or and a fused
    multiply-add of ``1 + q / 2**bits`` with x; per word, ``sum (1 + q/2**bits) x = sum x + sum(q x) / 2**bits``
    turns into the weights' sum with one more multiply-add: ``scale * sum(q x) + offset * sum(x)``. EARLY: the first
    K step's weights are read before the PDL wait (the same operations: the same bits)."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    GROUPS: tl.constexpr = BLOCK_W // GROUP_WORDS
    start = tl.program_id(1) * SPLIT_WORDS
    num_words = tl.minimum(K // PER_WORD, start + SPLIT_WORDS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols3 = cols[None, None, :]
    group_first = tl.arange(0, GROUPS) * GROUP_WORDS                                 # [GROUPS]
    tile_words = group_first[:, None, None] + tl.arange(0, GROUP_WORDS)[None, :, None]   # [GROUPS, GROUP_WORDS, 1]
    # a group's words share their factors: with GROUP_SUM (the tile's layout keeps a group's words in one thread,
    # quant_tiles.groups_in_thread) their products are summed before the factors apply, once per group and column
    acc = tl.zeros((GROUPS, 1 if GROUP_SUM else GROUP_WORDS, BLOCK_N), dtype=tl.float32)
    # pointers advanced a tile at a time; EVEN: every tile in bounds, no masks (as in quant_gemv_int8.py)
    low_ptrs = low_ptr + (start + tile_words) * N + cols3
    x_ptrs = x_ptr + (start + tile_words) * PER_WORD
    if EARLY:   # the first K step's weights read before the PDL wait (quant_tiles.EARLY_WEIGHTS)
        low, high_at, scale, offset = _float_weight_tile(start, low_ptrs, high_ptr, d_ptr, m_ptr, a_ptr,
                                                         b_ptr, tile_words, group_first, cols3, num_words, N,
                                                         LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE,
                                                         B_MODE, B_CONST, HAS_M, EVEN)
    wait_for_previous_kernel(USE_PDL)
    if EARLY:
        acc = _float_tile_step(acc, low, high_at, scale, offset, x_ptrs, start, tile_words, num_words, one_bits,
                               LOW_BITS, HIGH_BITS, FLOAT8, GROUP_SUM, EVEN, INTERPRET)
        low_ptrs += BLOCK_W * N
        x_ptrs += BLOCK_W * PER_WORD
    # STAGES > 1: Triton's software pipelining issues the next tiles' loads while this one computes
    for w0 in tl.range(start + BLOCK_W * EARLY, num_words, BLOCK_W, num_stages=STAGES):
        low, high_at, scale, offset = _float_weight_tile(w0, low_ptrs, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr,
                                                         tile_words, group_first, cols3, num_words, N, LOW_BITS,
                                                         HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE,
                                                         B_CONST, HAS_M, EVEN)
        acc = _float_tile_step(acc, low, high_at, scale, offset, x_ptrs, w0, tile_words, num_words, one_bits,
                               LOW_BITS, HIGH_BITS, FLOAT8, GROUP_SUM, EVEN, INTERPRET)
        low_ptrs += BLOCK_W * N
        x_ptrs += BLOCK_W * PER_WORD
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    splits = tl.num_programs(1)
    if splits > 1:
        tl.store(partial_ptr + tl.program_id(1) * N + cols, total, mask=cols < N)
    else:
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


def quant_gemv(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
               splits: int | None = None) -> None:
    """out[0] = weight @ x[0] (x [1, K] and out [1, N], contiguous)."""
    n, k = weight.out_features, weight.in_features
    tuned = None if config else gpu.tuned_entry(TUNED_QUANT_GEMV, x.device, quant_gemv_key(n, k, weight.layout, False))
    block_n, block_w, warps, *stages = tuned[:4] if tuned else config or GEMV_CONFIGS[weight.layout.low_bits]
    splits, split_words = split_k(cdiv(n, block_n), k, weight.layout.low_bits, block_w, x.device, splits,
                                  tuned[4] if tuned else GEMV_PROGRAMS_PER_SM)
    partials = out if splits == 1 else torch.empty((splits, n), dtype=torch.float32, device=x.device)
    lay = weight.layout
    gw = group_words(lay, block_w)
    _gemv_kernel[(cdiv(n, block_n), splits)](
        x, out, partials, *kernel_tensors(weight), n, k, split_words,
        ONE_BITS, **lay.kernel_args(), BLOCK_N=block_n,
        BLOCK_W=block_w, GROUP_WORDS=gw, GROUP_SUM=groups_in_thread(block_n, block_w, gw, warps),
        STAGES=stages[0] if stages else 1, EVEN=even_tiles(n, k, lay.low_bits, block_n, split_words),
        INTERPRET=bool(triton.knobs.runtime.interpret), EARLY=quant_tiles.EARLY_WEIGHTS, num_warps=warps,
        **pdl_options(x.device))
    if splits > 1:
        add_splits(partials, out, splits, n)
