"""The batch-1 low-bit GEMV on float activations (``quant_matmul`` calls it for one row of x; layouts that allow it
take quant_gemv_int8.py instead).

Each program owns BLOCK_N output features and walks K in tiles of quant_tiles.py, summing ``q * x`` per word and
applying the scale group's factors once (``scale * sum(q x) + offset * sum(x)``); one reduction at the end. When
the output features alone make too few programs to fill the GPU (a 4096-row weight is 128 tiles of 32), K is split
over programs too and a second small kernel adds the float32 partial sums.

Measured on the H200 (bench/quant_matmul_sweep.py, docs/benchmarks.md): its arithmetic (about four instructions per
weight) is ~40% of its time; a Q4_K Llama-3-8B decodes ~1.1x bf16 with it, ~1.4x with the int8-activation GEMV.

Paired form (``CVLLM_QUANT_GEMV_PAIRS=1``; 4-bit planes without a high plane, x in bf16 or float16: GPTQ/AWQ, whose
activations stay 16-bit, W4A16): a word's eight products are taken two at a time in 16-bit pairs, as the tensor-core
GEMMs' unpack does (quant_gemm_swapped.py). One ``lop3`` puts nibbles j and j + 4 into the mantissas of a pair of
128.0 (bf16; 1024.0 in float16), one pair FMA takes the 128 off exactly, one multiplies by x's elements j and j + 4
and adds: 15 instructions a word, then its two halves added as float32 (3 more), against 24 for the float form's
shift, or and float32 FMA an element. x comes as those pairs and each word's float32 sum, made once a call by a
small kernel (pair_activations), not as eight 16-bit loads, conversions and adds a word in every program. Compiled
for sm_90 on a CPU (bench/sass_stats.py float-gemv --layout gptq4_g128 --config C [--pairs]), loop instructions a
weight: 3.8 paired at (64, 32, 4, 3) (the float form 7.5 there), 3.6 at (32, 32, 4, 1) (4.8); the float form's
default (32, 32, 4, 3) 5.3. The products and their sums within a word round to x's 16-bit type (four pair FMAs a
half): errors about x's own rounding (bf16), below it (float16). Off by default until timed on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu
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


# the paired form (module docstring): off until timed on the H200 (bench/device/run_all.sh gemvpairs)
PAIRS_ENV = "CVLLM_QUANT_GEMV_PAIRS"
# the paired form's tile, untimed: of the tiles compiled for sm_90 on a CPU, among the fewest loop instructions a
# weight with the software pipeline kept (bench/sass_stats.py float-gemv --layout gptq4_g128 [--pairs]: (64, 32,
# 4, 3) 3.8 a weight, (32, 32, 4, 1) 3.6 without the pipeline; the float form's default (32, 32, 4, 3) 5.3, paired 4.9)
PAIRED_CONFIG = (64, 32, 4, 3)
# 16-bit x's dtype -> the pair form's code: the magic number's type and value (the nibble lands on its mantissa's
# last bits: 128.0 in bf16, 1024.0 in float16)
PAIR_TYPES = {torch.bfloat16: 1, torch.float16: 2}


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


def _pair_asm(kind: str, magic: int) -> str:
    """PTX of ``$0 = sum over the word's eight nibbles q of q * x`` (float32), x's pairs in $2..$5 (pair j: elements
    j and j + 4 of the word, low and high half), the word in $1. Only FMAs on pairs (sm_80), no subtraction op."""
    one = 0x3F80 if kind == "bf16" else 0x3C00
    lanes = []
    for j in range(4):
        src = "$1" if j == 0 else "s"
        if j:
            lanes.append(f"shr.b32 s, $1, {4 * j}; ")
        lanes.append(f"lop3.b32 t, {src}, 0x000F000F, c, 0xEA; fma.rn.{kind}x2 t, t, one, negc; ")
        lanes.append(f"fma.rn.{kind}x2 a, t, ${2 + j}, {'zero' if j == 0 else 'a'}; ")
    if kind == "bf16":   # a bf16's bits are the top half of its float32's
        tail = "shl.b32 lo, a, 16; and.b32 hi, a, 0xFFFF0000; add.f32 $0, lo, hi; "
    else:
        tail = "mov.b32 {h0, h1}, a; cvt.f32.f16 lo, h0; cvt.f32.f16 hi, h1; add.f32 $0, lo, hi; "
    return ("{ .reg .b32 c, negc, one, zero, s, t, a; .reg .f32 lo, hi; .reg .b16 h0, h1; "
            f"mov.b32 c, {magic | magic << 16:#x}; mov.b32 negc, {(magic | 0x8000) * 0x10001:#x}; "
            f"mov.b32 one, {one * 0x10001:#x}; mov.b32 zero, 0; " + "".join(lanes) + tail + "}")


PAIR_BF16_ASM = tl.constexpr(_pair_asm("bf16", 0x4300))
PAIR_F16_ASM = tl.constexpr(_pair_asm("f16", 0x6400))


@triton.jit
def _pair_kernel(x_ptr, pairs_ptr, sums_ptr, WORDS, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """x [WORDS * 8] (16-bit) -> pairs [WORDS, 4] (int32: pair j holds elements j and j + 4 of the word, low and
    high half) and sums [WORDS] (float32, each word's eight elements)."""
    wait_for_previous_kernel(USE_PDL)
    words = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = words < WORDS
    x = tl.load(x_ptr + words[:, None] * 8 + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0)
    tl.store(sums_ptr + words, tl.sum(x.to(tl.float32), axis=1), mask=ok)
    bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    low, high = tl.split(tl.permute(tl.reshape(bits, (BLOCK, 2, 4)), (0, 2, 1)))    # [BLOCK, 4] each
    tl.store(pairs_ptr + words[:, None] * 4 + tl.arange(0, 4)[None, :], low | (high << 16), mask=ok[:, None])


PAIR_BLOCK = 128   # words a program of the pair kernel takes


def pair_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] (16-bit, contiguous) -> (pairs int32 [K / 2], word sums float32 [K / 8]) for the paired GEMV."""
    words = x.numel() // 8
    pairs = torch.empty(words * 4, dtype=torch.int32, device=x.device)
    sums = torch.empty(words, dtype=torch.float32, device=x.device)
    _pair_kernel[(triton.cdiv(words, PAIR_BLOCK),)](x, pairs, sums, words, BLOCK=PAIR_BLOCK, num_warps=4,
                                                   **pdl_options(x.device))
    return pairs, sums


@triton.jit
def _half_to_float(bits, PAIRS: tl.constexpr):
    """The low 16 bits of int32s as bf16 (PAIRS 1) or float16 (2) values, in float32."""
    half = bits.to(tl.int16)
    if PAIRS == 1:
        return half.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return half.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _paired_word_dot(low, p0, p1, p2, p3, PAIRS: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 sum over each word's eight nibbles q of q * x, x's pairs p0..p3. The interpreter, which has no inline
    PTX, takes x from the pairs and sums exactly."""
    if INTERPRET:
        pairs = (p0, p1, p2, p3)
        total = tl.zeros(low.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            total += ((low >> (4 * j)) & 0xF).to(tl.float32) * _half_to_float(pairs[j] & 0xFFFF, PAIRS)
            total += ((low >> (4 * j + 16)) & 0xF).to(tl.float32) * _half_to_float((pairs[j] >> 16) & 0xFFFF,
                                                                                  PAIRS)
        return total
    else:
        zeros = tl.zeros_like(low)
        return tl.inline_asm_elementwise(PAIR_BF16_ASM if PAIRS == 1 else PAIR_F16_ASM, "=f,r,r,r,r,r",
                                         [low, p0 + zeros, p1 + zeros, p2 + zeros, p3 + zeros], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _gemv_kernel(x_ptr, xsum_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, SPLIT_WORDS, one_bits,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 GROUP_WORDS: tl.constexpr, GROUP_SUM: tl.constexpr, STAGES: tl.constexpr, EVEN: tl.constexpr,
                 INTERPRET: tl.constexpr, USE_PDL: tl.constexpr, PAIRS: tl.constexpr = 0):
    """Program (i, j) sums words j * SPLIT_WORDS .. (j + 1) * SPLIT_WORDS of output features i * BLOCK_N ...; with
    more than one split, ``out`` is the float32 [splits, N] of the partial sums (``sum_splits_kernel`` adds them).

    A tile is [BLOCK_W // GROUP_WORDS, GROUP_WORDS, BLOCK_N] words: GROUP_WORDS words share their factors (one
    scale group, or a part of one), loaded once per group and column. Per element: a shift, an or and a fused
    multiply-add of ``1 + q / 2**bits`` with x; per word, ``sum (1 + q/2**bits) x = sum x + sum(q x) / 2**bits``
    turns into the weights' sum with one more multiply-add: ``scale * sum(q x) + offset * sum(x)``. PAIRS (1: x in
    bf16, 2: float16; a 4-bit low plane alone): ``sum(q x)`` per word in 16-bit pairs (module docstring)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    GROUPS: tl.constexpr = BLOCK_W // GROUP_WORDS
    UNIT: tl.constexpr = 1.0 if FLOAT8 else float(1 << (LOW_BITS + HIGH_BITS))
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols3 = cols[None, None, :]
    start = tl.program_id(1) * SPLIT_WORDS
    num_words = tl.minimum(K // PER_WORD, start + SPLIT_WORDS)
    group_first = tl.arange(0, GROUPS) * GROUP_WORDS                                 # [GROUPS]
    tile_words = group_first[:, None, None] + tl.arange(0, GROUP_WORDS)[None, :, None]   # [GROUPS, GROUP_WORDS, 1]
    # a group's words share their factors: with GROUP_SUM (the tile's layout keeps a group's words in one thread,
    # quant_tiles.groups_in_thread) their products are summed before the factors apply, once per group and column
    acc = tl.zeros((GROUPS, 1 if GROUP_SUM else GROUP_WORDS, BLOCK_N), dtype=tl.float32)
    # pointers advanced a tile at a time; EVEN: every tile in bounds, no masks (as in quant_gemv_int8.py)
    low_ptrs = low_ptr + (start + tile_words) * N + cols3
    X_STRIDE: tl.constexpr = 4 if PAIRS else PER_WORD   # x's elements a word (PAIRS: its four int32 pairs)
    x_ptrs = x_ptr + (start + tile_words) * X_STRIDE
    # STAGES > 1: Triton's software pipelining issues the next tiles' loads while this one computes
    for w0 in tl.range(start, num_words, BLOCK_W, num_stages=STAGES):
        words = w0 + tile_words
        gwords = (w0 + group_first)[:, None, None]
        if EVEN:
            word_ok = None
            ok = None
            group_ok = None
        else:
            word_ok = words < num_words
            ok = word_ok & (cols3 < N)
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
        if PAIRS:
            tl.static_assert(LOW_BITS == 4 and HIGH_BITS == 0 and not FLOAT8, "pairs: a 4-bit low plane alone")
            # x as pair_activations made it: four pairs and the elements' sum a word (x_ptr: the pairs)
            part = _paired_word_dot(low, load_masked(x_ptrs + 0, word_ok, 0), load_masked(x_ptrs + 1, word_ok, 0),
                                    load_masked(x_ptrs + 2, word_ok, 0), load_masked(x_ptrs + 3, word_ok, 0),
                                    PAIRS, INTERPRET)
            x_sum = load_masked(xsum_ptr + words, word_ok, 0.0)
            # part = sum(q x) per word, summed over the group's words
            if GROUP_SUM:
                part = tl.sum(part, axis=1, keep_dims=True)
                x_sum = tl.sum(x_sum, axis=1, keep_dims=True)
            acc += part * scale + offset * x_sum
        else:
            part = tl.zeros((GROUPS, GROUP_WORDS, BLOCK_N), dtype=tl.float32)
            x_sum = tl.zeros((GROUPS, GROUP_WORDS, 1), dtype=tl.float32)
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
        low_ptrs += BLOCK_W * N
        x_ptrs += BLOCK_W * X_STRIDE
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    tl.store(out_ptr + tl.program_id(1) * N + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


def pairs_form(weight: QuantWeight, dtype: torch.dtype, pairs: bool | None = None) -> int:
    """The PAIRS code a GEMV of ``weight`` with x of ``dtype`` runs (0: the float form); ``pairs`` None: as
    CVLLM_QUANT_GEMV_PAIRS says, read per call as quant_gemv_int8.applies reads its switches (a decode step's GEMVs
    run from CUDA graphs: the read is at capture, not every step)."""
    lay = weight.layout
    if pairs is None:
        pairs = os.environ.get(PAIRS_ENV, "0") == "1"
    fits = lay.low_bits == 4 and not lay.high_bits and not lay.float8
    return PAIR_TYPES.get(dtype, 0) if pairs and fits else 0


def quant_gemv(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
               splits: int | None = None, pairs: bool | None = None) -> None:
    """out[0] = weight @ x[0] (x [1, K] and out [1, N], contiguous). ``pairs``: the paired form where the layout
    and x's dtype allow it (None: CVLLM_QUANT_GEMV_PAIRS)."""
    n, k = weight.out_features, weight.in_features
    paired = pairs_form(weight, x.dtype, pairs)
    # the tuned tiles are the float form's (the paired form's are untimed: its default, or the caller's)
    tuned = None if config or paired else gpu.tuned_entry(TUNED_QUANT_GEMV, x.device,
                                                          quant_gemv_key(n, k, weight.layout, False))
    default = PAIRED_CONFIG if paired else GEMV_CONFIGS[weight.layout.low_bits]
    block_n, block_w, warps, *stages = tuned[:4] if tuned else config or default
    splits, split_words = split_k(cdiv(n, block_n), k, weight.layout.low_bits, block_w, x.device, splits,
                                  tuned[4] if tuned else GEMV_PROGRAMS_PER_SM)
    target = out if splits == 1 else torch.empty((splits, n), dtype=torch.float32, device=x.device)
    lay = weight.layout
    gw = group_words(lay, block_w)
    x_args = pair_activations(x) if paired else (x, x)   # (the float form reads no sums: x again in their place)
    _gemv_kernel[(cdiv(n, block_n), splits)](
        *x_args, target, *kernel_tensors(weight), n, k, split_words, ONE_BITS, **lay.kernel_args(), BLOCK_N=block_n,
        BLOCK_W=block_w, GROUP_WORDS=gw, GROUP_SUM=groups_in_thread(block_n, block_w, gw, warps),
        STAGES=stages[0] if stages else 1, EVEN=even_tiles(n, k, lay.low_bits, block_n, split_words),
        INTERPRET=bool(triton.knobs.runtime.interpret), PAIRS=paired, num_warps=warps,
        **pdl_options(x.device))
    if splits > 1:
        add_splits(target, out, splits, n)
