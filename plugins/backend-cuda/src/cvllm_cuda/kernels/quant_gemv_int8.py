"""The batch-1 low-bit GEMV with int8 activations: llama.cpp's numerics for its formats (its CUDA backend rounds x
to int8 per 32 inputs, "q8_1", before every quantized matrix-vector product; so do vLLM's GGUF kernels).

Why: the float GEMV (quant_matmul._gemv_kernel) spends about four instructions per weight element (place the bits,
or in the exponent, multiply-add, and its share of x), which on the H200 is more time than reading the 4-bit weight
(bench/results/2026-12-02-h200-*: a load-only kernel of the same tiling takes ~60% of its time). With x in int8,
one ``dp4a`` multiplies four weight bytes by four activation bytes and adds them to an int32: a word of eight
4-bit weights is two masks, a shift and two ``dp4a``, under one instruction per element.

- ``quantize_activations`` (int8_activations.py): x [T, K] -> per 32 inputs d = max|x| / 127 and q = round(x / d),
  packed four per int32 in the order the weight words' bytes come out (below), and the sums the offsets multiply;
  made by the RMSNorm or silu * up that produced x where the model links them (``input_bits``;
  CVLLM_QUANT_PRODUCER_ACTIVATIONS=1), else by its own kernel before the GEMV.
- ``_gemv_int8_kernel``: a low-plane word of ``32 / bits`` elements masked with 0x0F0F0F0F (4-bit; 0x03030303
  2-bit; the word itself 8-bit) at shift ``s * bits`` holds elements ``s, s + P, s + 2P, s + 3P`` (P = 8 / bits)
  in its four bytes; the activation pack (word, s) holds the same elements' int8s. Per word
  ``scale * d_x * sum(q_w q_x) + offset * sum(x)``, the float formula with x rounded.
- High planes (Q6_K 4 + 2 bits, Q5_0, Q5_1, Q5_K 4 + 1, Q3_K 2 + 1: int8_bytes.weight_bytes): each byte then holds the
  element's whole integer, its high bits above the low ones (6 bits at most, so unsigned bytes times int8 still
  fit dp4a exactly); the activation packs are the same. A high-plane word spans 2 or 4 low words and is loaded
  once per factor group where a group is one (Q6_K, Q5_*). Q6_K's 2-bit pairs are masked into four copies of
  the high word once per high word, and one byte permute (``prmt``) per word and phase picks the bytes it
  needs, merged under the low bits with a single ``lop3``; the 1-bit planes are spread a chunk of elements per
  byte (a byte permute and a multiply), then shifted and masked per phase. SASS instructions in the main loop per
  weight element (sm_90, bench/sass_stats.py int8-gemv; the 4-bit tile (32, 64, 4, 3), the 2-bit (32, 32, 4)):
  Q4_K 2.0, Q6_K 3.5, Q5_K 2.8, Q5_0 2.5, Q3_K 2.6, Q2_K 2.1; the float GEMV's Q6_K 9.2 (its (32, 32, 4, 3)).

Layouts that set ``int8_activations`` (GGUF's) and whose planes fit a byte (not an 8-bit low plane with a high
one); FP8 and GPTQ/AWQ (W4A16) keep the float GEMV. ``CVLLM_QUANT_INT8_ACTIVATIONS=0`` keeps every layout on the
float GEMV (bit-comparable with the CPU path's dequantize-then-matmul). Triton's interpreter has no inline PTX:
there ``dp4a``, ``prmt`` and ``lop3`` are spelled out with shifts and masks (the tests run that; the GPU tests
run the instructions).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu
from cvllm_cuda.kernels.int8_activations import (
    BLOCK,
    attached,
    buffers,
    producers_on,
    quantize_activations,
)
from cvllm_cuda.kernels.int8_bytes import weight_bytes
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_gemv import GEMV_CONFIGS
from cvllm_cuda.kernels.quant_tiles import (
    add_splits,
    even_tiles,
    group_words,
    groups_in_thread,
    kernel_tensors,
    last_split,
    load_masked,
    prefetch_to_l2,
    prefetch_words,
    split_counters,
    split_k,
    summed_splits,
    word_factors,
)
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.kernels.tuned_matmul import TUNED_QUANT_GEMV, quant_gemv_key
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

# rows of x up to which quant_matmul takes this GEMV (decode batches, a batch-1 speculative verify step of the
# default 4 drafts): a row's numerics then do not depend on how many rows share the step. 5, not 8 (llama.cpp's
# q8_1 matrix-vector limit): with the rows together in a program (ROWS_PER_PROGRAM) the GEMV ties the swapped GEMM
# at 5 rows and loses at 8 (H200, a Llama-3-8B layer in a CUDA graph, 2026-12-04-h200-gemm_swapped_probe-gemvrows:
# Q4_K 128.1 us at 5 rows and 181.9 at 8 against 126.7-127.0; Q8_0 131.8 and 203.4 against the unpacked GEMM's
# 147-148, the swapped one's 130-132)
MAX_ROWS = 5
# (BLOCK_N, BLOCK_W, num_warps[, stages]) by low-plane bits, from bench/quant_gemv_stack.py (a stack of Llama-3-8B
# layers in one CUDA graph, H200, 2026-12-03): Q4_K 56.4 us a layer (the float GEMV's tiles (32, 32, 4): 60.7),
# Q8_0 79.3 (106.6); Q8_0 with three stages and one program per SM since 2026-12-04 (bench/tune_quant_gemv.py, each
# shape in a stack of 8 in a CUDA graph: qkv 13.6 -> 10.9 us, o 12.7 -> 8.8, gate_up 34.4 -> 33.6, down
# 24.4 -> 21.4); 2-bit unswept
INT8_GEMV_CONFIGS = {2: GEMV_CONFIGS[2], 4: (32, 64, 4, 3), 8: (64, 64, 4, 3)}
# programs per SM the K split aims at, by low-plane bits: Q4_K 54.7 us a layer at 1 (every SM one program), 56.8 at
# 4, 56.5 never split (2026-12-03, quant_gemv_stack.py); Q8_0 at 1 with three stages (above; with one stage 4 had won)
INT8_PROGRAMS_PER_SM = {2: 4, 4: 1, 8: 1}
# the widths (low bits, high bits) of the high planes the kernel unpacks (GGUF's Q6_K, Q5_*, Q3_K: an integer of at
# most 6 bits, within a byte of dp4a) and their (tile, programs per SM), not yet timed: Q5_* and Q3_K those of their
# low width (at MAX_ROWS rows 168 registers, no spill). Not Q6_K's: its 16-input groups keep a sum per word and row,
# and the 4-bit tile spills at MAX_ROWS rows (255 registers and 16 B of stack, as it did before this kernel took high
# planes); the same tile in 8 warps holds them (204 registers), and was the float GEMV's best Q6_K tile (GEMV_CONFIGS)
INT8_HIGH_PLANE_CONFIGS = {(4, 2): ((32, 64, 8, 3), 1), (4, 1): (INT8_GEMV_CONFIGS[4], INT8_PROGRAMS_PER_SM[4]),
                           (2, 1): (INT8_GEMV_CONFIGS[2], INT8_PROGRAMS_PER_SM[2])}
ENV = "CVLLM_QUANT_INT8_ACTIVATIONS"
# the high-plane layouts take this GEMV too (CVLLM_QUANT_INT8_HIGH_PLANES=0: the float GEMV, for A/B runs): on the
# H200 a Q4_K_M file's batch-1 decode 377 tok/s with it, 348 without (docs/benchmarks.md, 2026-12-05)
HIGH_PLANES_ENV = "CVLLM_QUANT_INT8_HIGH_PLANES"


def applies(layout: QuantLayout, in_features: int) -> bool:
    """Whether the batch-1 product of a weight in ``layout`` takes this path."""
    widths = (layout.low_bits, layout.high_bits)
    planes_ok = not widths[1] or (widths in INT8_HIGH_PLANE_CONFIGS and os.environ.get(HIGH_PLANES_ENV, "1") != "0")
    return (layout.int8_activations and not layout.float8 and planes_ok and in_features % BLOCK == 0
            and os.environ.get(ENV, "1") != "0")


def input_bits(layer, rows: int) -> int | None:
    """The low-plane width whose int8 form of x [rows, K] the low-bit linear ``layer`` takes (every part of a fused
    layer the same one), or None: a layer of another kind, more rows than MAX_ROWS, parts of different widths, or
    CVLLM_QUANT_PRODUCER_ACTIVATIONS not 1. What a producer linked to ``layer`` makes beside its output."""
    weight = getattr(layer, "quant_weight", None)
    weights = [weight] if weight is not None else [part for _, part in getattr(layer, "quant_parts", ())]
    if not weights or rows > MAX_ROWS or not producers_on():
        return None
    widths = {w.layout.low_bits if applies(w.layout, w.in_features) else None for w in weights}
    return widths.pop() if len(widths) == 1 else None


def output_form(out: torch.Tensor, feeds, rows: int) -> tuple[int, tuple[torch.Tensor, ...]]:
    """For a producer of ``out`` ([rows, K]) that feeds the layer ``feeds`` (None: unknown): the low-plane width of
    the int8 form to make beside it and room for it (int8_activations.buffers), or (0, ``out`` four times:
    placeholders the kernel never touches)."""
    bits = input_bits(feeds, rows) if feeds is not None and rows else None
    return (bits, buffers(out.numel(), bits, out.device)) if bits else (0, (out,) * 4)


def default_tiles(layout: QuantLayout) -> tuple[tuple, int]:
    """(BLOCK_N, BLOCK_W, num_warps[, stages]) and the programs per SM the K split aims at, untuned."""
    if layout.high_bits:
        return INT8_HIGH_PLANE_CONFIGS[layout.low_bits, layout.high_bits]
    return INT8_GEMV_CONFIGS[layout.low_bits], INT8_PROGRAMS_PER_SM[layout.low_bits]


@triton.jit
def _dot4(a, b, c, INTERPRET: tl.constexpr):
    """c + the sum over the four bytes of the unsigned bytes of ``a`` times the signed bytes of ``b``."""
    if INTERPRET:
        for j in tl.static_range(4):
            c += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)   # arithmetic shift: sign-extended
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _row_step(acc, wbytes, scale, offset, pack_ptrs, xd_ptr, xsum_ptr, xblock_sum_ptr, words, gwords, word_ok,
              num_words, LOW_BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, ONE_BLOCK: tl.constexpr,
              EVEN: tl.constexpr, INTERPRET: tl.constexpr):
    """One row of x's share of a K step: ``acc`` plus the tile's words (``wbytes``, their dp4a operands per phase,
    made once for all the rows) times the row's int8 packs, summed per group (ONE_BLOCK) or per word. The same
    operations for every row and every number of rows, so a row's output does not depend on the rows beside it."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    PHASES: tl.constexpr = 8 // LOW_BITS
    dots = tl.zeros(wbytes[0].shape, dtype=tl.int32)
    for s in tl.static_range(PHASES):
        pack = load_masked(pack_ptrs + s, word_ok, 0)
        dots = _dot4(wbytes[s], pack + tl.zeros_like(dots), dots, INTERPRET)
    if ONE_BLOCK:
        block = gwords // GROUP_WORDS
        block_ok = None if EVEN else gwords < num_words
        x_d = load_masked(xd_ptr + block, block_ok, 0.0)
        x_sum = load_masked(xblock_sum_ptr + block, block_ok, 0.0)
        acc += tl.sum(dots, axis=1, keep_dims=True).to(tl.float32) * (x_d * scale) + offset * x_sum
    else:
        x_d = load_masked(xd_ptr + words * PER_WORD // 32, word_ok, 0.0)
        x_sum = load_masked(xsum_ptr + words, word_ok, 0.0)
        acc += (dots.to(tl.float32) * x_d) * scale + offset * x_sum
    return acc


@triton.jit(do_not_specialize=["T", "stride_ot"])
def _gemv_int8_kernel(packs_ptr, xd_ptr, xsum_ptr, xblock_sum_ptr, out_ptr, partial_ptr, counters_ptr, low_ptr,
                      high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, SPLIT_WORDS, T, stride_ot,
                      LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                      SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                      HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                      GROUP_WORDS: tl.constexpr, GROUP_SUM: tl.constexpr, STAGES: tl.constexpr,
                      EVEN: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
                      ROWS: tl.constexpr = 1, FUSED_SUM: tl.constexpr = False, PREFETCH_WORDS: tl.constexpr = 0):
    """The float GEMV's tiling and splits (quant_matmul._gemv_kernel), integer dot products per word. Where a factor
    group is one activation block (32 inputs: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0), the group's word products
    are added as integers and turned into a float once per group and column, not once per word. A high plane's
    words come with the low words' tile, one per factor group where a group is one high word (Q6_K, Q5_*), else
    one per low word (Q3_K), and each word's bytes are made once for all the rows (weight_bytes). ROWS rows of x a
    program, rows ``program_id(0) * ROWS`` on (a few rows: a decode batch, a speculative verify step): each weight
    tile is loaded and its factors computed once for all of them, and each row is summed as it is alone
    (_row_step), so a row's output does not depend on the others or on ROWS; the tiles and K splits depend on the
    weight only. A last program with fewer rows computes its last row again in their place and stores nothing for
    them. Out row t at ``t * stride_ot``; with K splits, split j's partial sums of row t at ``partial_ptr + (j * T +
    t) * N`` (float32), added by sum_splits_kernel or, FUSED_SUM, by the split that finishes last
    (quant_tiles.last_split). PREFETCH_WORDS: the first words of the program's K range fetched into L2 before it
    waits for the previous kernel (quant_tiles.prefetch_words), by the first program of a column tile's rows."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    PHASES: tl.constexpr = 8 // LOW_BITS
    GROUPS: tl.constexpr = BLOCK_W // GROUP_WORDS
    start = tl.program_id(2) * SPLIT_WORDS
    num_words = tl.minimum(K // PER_WORD, start + SPLIT_WORDS)
    if PREFETCH_WORDS > 0:
        if tl.program_id(0) == 0:
            prefetch_to_l2(low_ptr, start, num_words, tl.program_id(1) * BLOCK_N, N, PREFETCH_WORDS, BLOCK_N)
    wait_for_previous_kernel(USE_PDL)
    first_row = tl.program_id(0) * ROWS
    packs_ptr += first_row * (K // 4)
    xd_ptr += first_row * (K // 32)
    xblock_sum_ptr += first_row * (K // 32)
    xsum_ptr += first_row * (K // PER_WORD)
    # each row's offset from the first (a last program's missing rows repeat its last row)
    row_offsets = (0,)
    for r in tl.static_range(1, ROWS):
        row_offsets = row_offsets + (tl.minimum(first_row + r, T - 1) - first_row,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols3 = cols[None, None, :]
    group_first = tl.arange(0, GROUPS) * GROUP_WORDS
    tile_words = group_first[:, None, None] + tl.arange(0, GROUP_WORDS)[None, :, None]   # [GROUPS, GROUP_WORDS, 1]
    ONE_BLOCK: tl.constexpr = GROUP_WORDS * PER_WORD == 32 and GROUP_SUM   # (quant_tiles.groups_in_thread)
    accs = ()
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros((GROUPS, 1 if ONE_BLOCK else GROUP_WORDS, BLOCK_N), dtype=tl.float32),)
    # pointers advanced a tile at a time (recomputing them from the word index was a quarter of the loop's
    # instructions); EVEN: every tile in bounds, no masks
    low_ptrs = low_ptr + (start + tile_words) * N + cols3                       # [GROUPS, GROUP_WORDS, BLOCK_N]
    pack_ptrs = packs_ptr + (start + tile_words) * PHASES                       # [GROUPS, GROUP_WORDS, 1]
    # a high-plane word spans LOW_BITS / HIGH_BITS low words (whole ones per tile and split: which part of it a
    # word holds is the same every step); where a factor group is one high word (Q6_K, Q5_*), it is loaded once
    # per group, [GROUPS, 1, BLOCK_N] as the factors are, else once per low word
    WORDS_PER_HIGH: tl.constexpr = LOW_BITS // HIGH_BITS if HIGH_BITS > 0 else 1
    HIGH_PER_GROUP: tl.constexpr = GROUP_WORDS == WORDS_PER_HIGH
    part = tile_words % WORDS_PER_HIGH
    if HIGH_BITS > 0:
        tl.static_assert(BLOCK_W % WORDS_PER_HIGH == 0, "a tile must hold whole high-plane words")
        if HIGH_PER_GROUP:
            high_ptrs = high_ptr + ((start + group_first) // WORDS_PER_HIGH)[:, None, None] * N + cols3
        else:
            high_ptrs = high_ptr + (start + tile_words) // WORDS_PER_HIGH * N + cols3
    # STAGES > 1: the next tiles' loads are issued while this one computes
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
        high = low
        if HIGH_BITS > 0:
            high = load_masked(high_ptrs, group_ok if HIGH_PER_GROUP else ok, 0)
            high_ptrs += BLOCK_W // WORDS_PER_HIGH * N
        wbytes = weight_bytes(low, high, part, LOW_BITS, HIGH_BITS, INTERPRET)
        # the factors loaded as [GROUPS, 1, BLOCK_N], in the tile's own layout: loaded [GROUPS, BLOCK_N] they would
        # be moved through shared memory every step, a barrier that stalls all the program's warps
        scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, gwords * PER_WORD, cols3, group_ok, N, SCALE_GROUP,
                                      SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
        stepped = ()
        for r in tl.static_range(ROWS):
            at = row_offsets[r]
            stepped = stepped + (_row_step(accs[r], wbytes, scale, offset, pack_ptrs + at * (K // 4),
                                           xd_ptr + at * (K // 32), xsum_ptr + at * (K // PER_WORD),
                                           xblock_sum_ptr + at * (K // 32), words, gwords, word_ok, num_words,
                                           LOW_BITS, GROUP_WORDS, ONE_BLOCK, EVEN, INTERPRET),)
        accs = stepped
        low_ptrs += BLOCK_W * N
        pack_ptrs += BLOCK_W * PHASES
    splits = tl.num_programs(2)
    for r in tl.static_range(ROWS):
        row = first_row + r
        total = tl.sum(tl.sum(accs[r], axis=1), axis=0)
        if splits > 1:
            tl.store(partial_ptr + (tl.program_id(2) * T + row).to(tl.int64) * N + cols, total,
                     mask=(cols < N) & (row < T))
        else:
            tl.store(out_ptr + row.to(tl.int64) * stride_ot + cols, total.to(out_ptr.dtype.element_ty),
                     mask=(cols < N) & (row < T))
    if FUSED_SUM:
        if splits > 1:
            if last_split(counters_ptr, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), splits):
                for r in tl.static_range(ROWS):
                    row = first_row + r
                    ok = (cols < N) & (row < T)
                    total = summed_splits(partial_ptr + row.to(tl.int64) * N, cols, ok, splits, T * N)
                    tl.store(out_ptr + row.to(tl.int64) * stride_ot + cols, total.to(out_ptr.dtype.element_ty),
                             mask=ok)


# rows of x a GEMV program takes: each weight tile then comes from memory and is unpacked once for all of them, and
# each row is summed as when alone (the same bits). All of them up to MAX_ROWS by default: a Llama-3-8B layer in a
# CUDA graph on the H200 (bench/results/2026-12-04-h200-gemm_swapped_probe-gemvrows-6ca7c93.json), us at 1 / 2 / 3 /
# 4 / 5 rows, a program a row -> rows together: Q4_K 58.5 / 79.7 / 110.4 / 137.8 / 165.2 -> 57.5 / 70.4 / 93.1 /
# 110.6 / 128.1; Q8_0 74.0 / 86.5 / 104.1 / 126.5 / 147.1 -> 74.9 / 79.6 / 102.0 / 116.1 / 131.8. But only where the
# weight stream is the cost: a small layer is read in a few us either way, and there a program a row runs five
# times the programs in parallel. The demo model's layers (576 wide: 0.3-1.8M weights) in a batch-1 verify step of
# 5 rows, on the H200 in CUDA graphs: forward pass 1.141 ms with the rows together, 0.976 ms a program a row
# (docs/benchmarks.md, session 24). So rows together from ROWS_TOGETHER_MIN_WEIGHTS (a Llama-3-8B layer has 16-117M;
# sizes in between are not measured). CVLLM_GEMV_ROWS_PER_PROGRAM=N sets it for every layer (1 = a program a row).
ROWS_TOGETHER_MIN_WEIGHTS = 1 << 22
ROWS_PER_PROGRAM = int(os.environ.get("CVLLM_GEMV_ROWS_PER_PROGRAM", "0")) or None


def program_rows(rows: int, n: int, k: int) -> int:
    """Rows of x a GEMV program takes for a weight [n, k] (ROWS_PER_PROGRAM where set)."""
    if ROWS_PER_PROGRAM:
        return max(1, min(rows, ROWS_PER_PROGRAM))
    return rows if n * k >= ROWS_TOGETHER_MIN_WEIGHTS else 1


def quant_gemv_int8(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
                    splits: int | None = None, activations: tuple[torch.Tensor, ...] | None = None,
                    rows_per_program: int | None = None) -> None:
    """out[t] = weight @ x[t] with x rounded to int8 per 32 inputs, for x [T, K] (contiguous; T up to MAX_ROWS) and
    out [T, N] (last dimension contiguous). Every row's output is bit for bit what a call with that row alone
    gives: the tiles and K splits depend on the weight only. ``activations``: x already rounded by
    ``quantize_activations`` (benchmarks time the GEMV without its quantizer that way); ``rows_per_program``: rows
    of x a program takes (default: program_rows)."""
    lay = weight.layout
    n, k = weight.out_features, weight.in_features
    t = x.shape[0]
    if not x.is_contiguous():
        x = x.contiguous()
    tuned = None if config else gpu.tuned_entry(TUNED_QUANT_GEMV, x.device, quant_gemv_key(n, k, lay, True))
    default, programs_per_sm = default_tiles(lay)
    block_n, block_w, warps, *stages = tuned[:4] if tuned else config or default
    if activations is None:
        activations = attached(x, lay.low_bits) or quantize_activations(x, lay.low_bits)
    splits, split_words = split_k(cdiv(n, block_n), k, lay.low_bits, block_w, x.device, splits,
                                  tuned[4] if tuned else programs_per_sm)
    partials = out if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    gw = group_words(lay, block_w)
    launch = pdl_options(x.device)
    rows = max(1, min(t, rows_per_program)) if rows_per_program else program_rows(t, n, k)
    grid = (cdiv(t, rows), cdiv(n, block_n), splits)
    counters = split_counters(x.device, grid[0] * grid[1]) if splits > 1 else None
    _gemv_int8_kernel[grid](
        *activations, out, partials, partials if counters is None else counters, *kernel_tensors(weight), n, k,
        split_words, t, out.stride(0), **lay.kernel_args(), BLOCK_N=block_n,
        BLOCK_W=block_w, GROUP_WORDS=gw, STAGES=stages[0] if stages else 1,
        GROUP_SUM=groups_in_thread(block_n, block_w, gw, warps),
        EVEN=even_tiles(n, k, lay.low_bits, block_n, split_words),
        INTERPRET=bool(triton.knobs.runtime.interpret), ROWS=rows, FUSED_SUM=counters is not None,
        PREFETCH_WORDS=prefetch_words(grid[1] * grid[2], block_n, split_words, x.device), num_warps=warps, **launch)
    if splits > 1 and counters is None:
        add_splits(partials, out, splits, n)
