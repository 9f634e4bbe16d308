"""The 4-bit GEMV on 16-bit activations (W4A16: GPTQ/AWQ's numerics) through tensor-core MMAs, for 1-16 rows of x.

Why: the float GEMV (quant_gemv.py) spends ~5.3 SASS instructions a weight (a shift, a masked or, a float FMA, and
x's conversions and sums), and GPTQ's batch 1 sits at 1.38x bf16 against the issue's 2.2x. A tensor core multiplies
a 16 x 16 bf16 tile by 16 x 8 in one instruction a warp, so the weights only have to become bf16: one masked or puts
two nibbles into the mantissas of a pair of 128.0 (``(w >> 4 i) & 0x000F000F | 0x43004300`` is 128 + q for nibbles i
and i + 4), exactly, and the MMA multiplies those pairs by x's bf16 pairs exactly into float32 sums: ~1.7
instructions a weight, and the weights are never rounded (Marlin rounds the dequantized weight to bf16; here q stays
an integer and the factors apply in float32).

Each ``mma.sync.m16n8k16`` (mma_fragments.py: the lanes' registers as its fragments) takes the weight as its first
operand (16 output features) and x as its second (8 tokens, a "token group"; rows past T zero), reading the planes
as they are (quant_planes.py: word w of feature n holds inputs 8 w .. 8 w + 7, features contiguous; no repack, no
copy). Lane t of a warp is (g, j) = (t // 4, t % 4). For a "unit" of 32 inputs at k0 it loads

- word k0 / 8 + j of FW consecutive features n0 + FW g ... (16-byte loads; a warp reads four rows of the plane):
  block b's first-operand rows g and g + 8 are the lane row's features 2 b and 2 b + 1;
- x[token g of each group, k0 + 8 j .. k0 + 8 j + 7] (16 bytes).

Lane (g, j) holds inputs 2 j, 2 j + 1 (registers a0 / a1, b0) and 2 j + 8, 2 j + 9 (a2 / a3, b1) of the MMA's K; the
inputs are permuted the same way on both sides: the first MMA of a block takes nibbles (0, 4) as (2 j, 2 j + 1) and
(1, 5) as (2 j + 8, 2 j + 9), with x's pairs (x0, x4) and (x1, x5); the second the nibbles (2, 6), (3, 7) with
(x2, x6), (x3, x7). Then lane (g, j) holds tokens 2 j and 2 j + 1's sums for its features 2 b (c0, c1) and 2 b + 1
(c2, c3). Two more MMAs a token group with a first operand of ones give each token's sum of x, X. A scale group's
units are summed, then its factors apply in float32:

    y += scale * sum((128 + q) x) + (offset - 128 scale) * X,    the layout's value q * scale + offset.

Layouts: 4-bit planes without a high plane whose scale groups are whole multiples of 32 inputs (GPTQ/AWQ at every
group size, Q4_0, Q4_1, Q4_K), bf16 x (``applies``). quant_matmul routes 1-ROUTED_ROWS rows of the layouts that take
float activations (GPTQ/AWQ) here; ``CVLLM_GEMV_MMA=0`` (read at import) turns it off (docs/benchmarks.md, session 39).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu, quant_tiles, split_tickets
from cvllm_cuda.kernels.mma_gemv_step import apply_factors, step_factors, step_mma, step_words, zeros
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_gemm_swapped import in_lanes
from cvllm_cuda.kernels.quant_tiles import add_splits, kernel_tensors
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.kernels.split_tickets import last_split, summed_splits
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

ENABLED = os.environ.get("CVLLM_GEMV_MMA", "1") != "0"
MAX_ROWS = 16           # rows of x: two groups of 8 tokens (the MMA's second operand's columns)
# rows quant_matmul sends here: on the H100 (2026-12-06, bench/mma_gemv_probe.py, a Llama-3-8B layer's four products,
# GPTQ-4bit g128) 1 row 65.2 us against the float GEMV's 69.9, 2 rows 72.0 against the swapped GEMM's 94.5, 4 rows 75.1
# against 97.6, 8 rows 100.1 against 99.2, 16 rows 110.4 against 104.0; batch-1 --isq gptq 319.2 -> 335.2 tok/s. The
# int8 GEMV's layouts (Q4_K, Q4_0, Q4_1) keep it: Q4_K 1 row 85.4 against its 66.0, 2 rows 84.4 against 79.4 (4 rows
# 87.2 against 125.2, but 3-5 rows share the int8 producers' path)
ROUTED_ROWS = 8
# the kernel's PREFETCH for 1-8 rows (``CVLLM_GEMV_MMA_PREFETCH=0`` turns it off): the loop carries the next K step's
# words and factors, 128 registers, so 16 warps an SM at most. End to end it gains less than the probe says: batch-1
# --isq gptq on an H100 (d9a4b91, K splits added in the launch) 379.5 tok/s with it against 377.4 without (the probe
# put its tile at 115 us a step, the step gained 6). The tiles: on the H100 (2026-12-06, 8fa42af,
# bench/mma_gemv_probe.py, GPTQ-4bit g128, us a Llama-3-8B layer's four products, K splits added in the launch) 2
# warps a program at 16 warps an SM: 1 row 54.0 (4 warps at 12: 56.3; no PREFETCH, 4 warps at 16: 57.6), 2 rows
# 56.2, 4 rows 63.6; at 8 rows 16 warps an SM lose (98.2) and 8 win (93.9; no PREFETCH 98.4). Up to 4 rows the K
# split aims at 12 warps an SM, not the probe's 16: 16 of 128 registers fill an SM's register file, and the norm,
# rotary or silu PDL launches after the GEMV could not be placed beside it (WARPS_PER_SM below). End to end on the
# H100 (2026-12-06, 688d3bb, `run_all.sh mmaroom`, batch-1 --isq gptq, alternating in one call) 384.9-386.7 tok/s
# at 12 against 378.1-379.6 at 16 (GPU step 2.534-2.543 ms against 2.579-2.581); 10 and 8 ran as 16 did
PREFETCH = os.environ.get("CVLLM_GEMV_MMA_PREFETCH", "1") != "0"
PREFETCHED_TILE_UP_TO_4 = (8, 2, 12)
PREFETCHED_TILE_UP_TO_8 = (8, 2, 8)
UNIT = 32               # inputs a lane's words span in one word row (8 each, lanes j = 0..3): one unit
MAX_GROUP_UNITS = 4     # units a K step takes at most (GPTQ g128: a scale group a step)
# (words a lane reads a word row, i.e. features a lane row: a warp 8 FW features; warps a program; warps an SM the K
# split aims at) by rows of x. On the H200 (2026-12-06, bench/mma_gemv_probe.py, GPTQ-4bit g128, a Llama-3-8B layer's
# four products, 4-byte word loads then): 1 row 61.9 us with 4 warps at 32 warps an SM against 67.7 at 16, 68.9 at
# 64 and 77.3 with quant_tiles.k_splits (its splits at least four K steps long: 5.8 warps an SM on qkv); 8 rows 77.3
# us with 1 warp at 16 against 91.3 with 4. 2-7 rows and 9-16 (two token groups, half the features a lane: fewer
# registers) are not measured
# The early weights (quant_tiles.EARLY_WEIGHTS, the default) take the 1-row kernel from 70 registers to 80 (24 warps
# an SM fit at once rather than 28), and its best K split moved. On the H100 (2026-12-06, 61d3c64,
# `run_all.sh mmatiles`) at 1 row: early weights 64.4 us at 16 warps an SM, 64.6 at 20, 71.7 at 24, 74.1 at 32;
# without them 68.6 at 16, 65.5 at 24, 65.2 at 28, 65.5 at 32 (on the H200 batch-1 GPTQ had run 369.1 tok/s with
# the early weights at 32 against 386.0 without)
TILES = {1: (8, 4, 16)}
TILES_WITHOUT_EARLY_WEIGHTS = {1: (8, 4, 32)}
TILES_UP_TO_8 = (8, 1, 16)
TILES_UP_TO_16 = (4, 1, 16)
# CVLLM_GEMV_MMA_WARPS_PER_SM=N (read at import; unset by default): the K split aims at N warps an SM whatever the
# tile's. Why the 1-4-row tile aims at 12: at 16 warps an SM of 128 registers the GEMV holds an SM's whole register
# file, so the kernel after it (a norm, rotary, silu: launched early by PDL to wait on the SMs) cannot be placed until
# the GEMV's programs leave; at 12 a norm's program (8 warps of 48 registers) fits beside them. The stack probes time
# GEMVs back to back, never beside those kernels; `bash bench/device/run_all.sh mmaroom` times batch-1 GPTQ end to end
WARPS_PER_SM = int(os.environ.get("CVLLM_GEMV_MMA_WARPS_PER_SM", "0")) or None


def prefetches(rows: int) -> bool:
    """Whether ``rows`` rows of x take the kernel's PREFETCH by default."""
    return PREFETCH and rows <= 8   # (one token group: 9-16 rows keep their tile, never timed with it)


def tile(rows: int) -> tuple[int, int, int]:
    """(FW, warps, warps an SM) for ``rows`` rows of x (the last WARPS_PER_SM where set)."""
    if prefetches(rows):
        words, warps, per_sm = PREFETCHED_TILE_UP_TO_4 if rows <= 4 else PREFETCHED_TILE_UP_TO_8
    else:
        tiles = TILES if quant_tiles.EARLY_WEIGHTS else TILES_WITHOUT_EARLY_WEIGHTS
        words, warps, per_sm = tiles.get(rows, TILES_UP_TO_8 if rows <= 8 else TILES_UP_TO_16)
    return words, warps, WARPS_PER_SM or per_sm


@triton.jit
def _gemv_mma_kernel(x_ptr, out_ptr, partial_ptr, counters_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, T,
                     stride_ot, SPLIT_WORDS, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr,
                     SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr,
                     B_MODE: tl.constexpr, B_CONST: tl.constexpr, HAS_M: tl.constexpr, FLOAT8: tl.constexpr,
                     KU: tl.constexpr, W: tl.constexpr, FW: tl.constexpr, TG: tl.constexpr, STAGES: tl.constexpr,
                     EVEN_N: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
                     EARLY: tl.constexpr = False, PREFETCH: tl.constexpr = False, FUSED_SUM: tl.constexpr = False,
                     SPLITS: tl.constexpr = 1):
    """Program (i, s): output features i * 8 FW W ... over words s * SPLIT_WORDS ...: a warp 8 FW features (lane row
    g's FW features n0 + FW g ...), KU units a K step (within one scale group), TG groups of 8 tokens. x is read as
    int32 bf16 pairs [T, K / 2] at ``x_ptr``; out's rows are ``stride_ot`` apart. With more than one split, each
    stores float32 partial sums [splits, T, N], added by sum_splits_kernel or, FUSED_SUM (SPLITS of them), by the
    split that finishes last (split_tickets.py; ``counters_ptr``: its tickets). (LOW_BITS, HIGH_BITS, FLOAT8: the
    layout's, always 4, 0, False here: ``applies``.) EARLY: the first K step's words and factors are read
    before the PDL wait (quant_tiles.EARLY_WEIGHTS; a split is one K step at least). PREFETCH: each K step's words
    and factors are loaded during the step before (masked off past the split's end). Every tensor is [W * 32] (or
    [W * 32, 4] rows) in lane order (mma_fragments.py; a compile test holds the layouts)."""
    BLOCKS: tl.constexpr = FW // 2
    e = tl.arange(0, W * 32)
    g = (e % 32) // 4
    j = e % 4
    first_feature = tl.program_id(0) * (8 * FW * W) + (e // 32) * (8 * FW) + FW * g
    start = tl.program_id(1) * SPLIT_WORDS
    end = tl.minimum(K // 8, start + SPLIT_WORDS)
    low_ptrs = low_ptr + (start + j) * N + first_feature           # the lane reads word k0 / 8 + j of its features
    # x's pairs: token g (of each group) inputs k0 + 8 j + 2 p, + 1 at int32 (k0 + 8 j) / 2 + p
    x_ptrs = x_ptr + g[:, None] * (K // 2) + start * 4 + 4 * j[:, None] + tl.arange(0, 4)[None, :]
    zero = tl.zeros((W * 32,), dtype=tl.float32)
    y = zeros(zero, FW * TG * 2)
    if EARLY:   # the first K step's words and factors (weights: no kernel writes them) before the wait; x after it
        words = step_words(low_ptrs, first_feature, N, KU, FW, EVEN_N)
        factors = step_factors(start, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP, SUPER_GROUP,
                                A_MODE, B_MODE, B_CONST, HAS_M, FW, EVEN_N)
    wait_for_previous_kernel(USE_PDL)
    if PREFETCH:   # the loop carries the next step's words and factors, loaded before this step's MMAs
        if not EARLY:
            words = step_words(low_ptrs, first_feature, N, KU, FW, EVEN_N)
            factors = step_factors(start, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP, SUPER_GROUP,
                                    A_MODE, B_MODE, B_CONST, HAS_M, FW, EVEN_N)
        for w0 in tl.range(start, end, KU * 4):
            more = w0 + KU * 4 < end
            next_words = step_words(low_ptrs + KU * 4 * N, first_feature, N, KU, FW, EVEN_N, more)
            next_factors = step_factors(w0 + KU * 4, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP,
                                         SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, FW, EVEN_N, more)
            acc = step_mma(words, low_ptrs, first_feature, N, x_ptrs, g, T, K, zero, KU, FW, TG, BLOCKS, EVEN_N,
                            INTERPRET, True)
            y = apply_factors(y, acc, factors, w0, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP,
                               SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, EVEN_N, TG, BLOCKS, True)
            words = next_words
            factors = next_factors
            low_ptrs += KU * 4 * N
            x_ptrs += KU * 16
    else:
        if EARLY:
            acc = step_mma(words, low_ptrs, first_feature, N, x_ptrs, g, T, K, zero, KU, FW, TG, BLOCKS, EVEN_N,
                            INTERPRET, True)
            y = apply_factors(y, acc, factors, start, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP,
                               SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, EVEN_N, TG, BLOCKS, True)
            low_ptrs += KU * 4 * N
            x_ptrs += KU * 16
        for w0 in tl.range(start + KU * 4 * EARLY, end, KU * 4, num_stages=STAGES):
            acc = step_mma((), low_ptrs, first_feature, N, x_ptrs, g, T, K, zero, KU, FW, TG, BLOCKS, EVEN_N,
                            INTERPRET, False)
            y = apply_factors(y, acc, (), w0, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP,
                               SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, EVEN_N, TG, BLOCKS, False)
            low_ptrs += KU * 4 * N
            x_ptrs += KU * 16
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    for h in tl.static_range(FW):
        for t in tl.static_range(TG):
            _store(out_ptr, partial_ptr, y[(h * TG + t) * 2], 8 * t + 2 * j, first_feature + h, split, splits, T, N,
                   stride_ot)
            _store(out_ptr, partial_ptr, y[(h * TG + t) * 2 + 1], 8 * t + 2 * j + 1, first_feature + h, split, splits,
                   T, N, stride_ot)
    if FUSED_SUM:
        if last_split(counters_ptr, tl.program_id(0), SPLITS):   # every split's partials are in: add them here
            # (the program's features a thread or two each, a row at a time: every thread loads, where the lanes'
            # layout would leave all but one row's lanes idle at 1 row)
            fs = tl.program_id(0) * (8 * FW * W) + tl.arange(0, 8 * FW * W)
            f_ok = fs < N
            for row in range(0, T):
                total = summed_splits(partial_ptr + row * N + fs, f_ok, T * N, SPLITS, 8)
                tl.store(out_ptr + row * stride_ot + fs, total.to(out_ptr.dtype.element_ty), mask=f_ok)


@triton.jit
def _store(out_ptr, partial_ptr, y, row, f, split, splits, T, N, stride_ot):
    ok = (row < T) & (f < N)
    if splits > 1:
        tl.store(partial_ptr + (split * T + row) * N + f, y, mask=ok)
    else:
        tl.store(out_ptr + row * stride_ot + f, y.to(out_ptr.dtype.element_ty), mask=ok)


def group_units(layout: QuantLayout) -> int:
    """Units (32 inputs) a K step takes: the most, up to MAX_GROUP_UNITS, that divide a scale group."""
    units = layout.scale_group // UNIT
    ku = MAX_GROUP_UNITS
    while units % ku:
        ku //= 2
    return ku


def applies(layout: QuantLayout, dtype: torch.dtype, in_features: int) -> bool:
    """Whether this GEMV can take a weight in ``layout`` times x of ``dtype``."""
    return (in_lanes(layout, dtype) and layout.scale_group % UNIT == 0
            and in_features % (UNIT * group_units(layout)) == 0)


def split_count(n: int, k: int, ku: int, features: int, warps: int, warps_per_sm: int,
                device: torch.device) -> int:
    """K splits so that about ``warps_per_sm`` warps run an SM (a program ``features`` wide), each split one K step
    (KU units) at least."""
    columns = cdiv(n, features)
    steps = k // (UNIT * ku)
    if device.type != "cuda":
        return 1 if steps < 2 else 2   # the interpreter: both paths
    return max(1, min(steps, cdiv(warps_per_sm * gpu.num_sms(gpu.device_index(device)), columns * warps)))


def quant_gemv_mma(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, warps: int | None = None,
                   splits: int | None = None, stages: int = 1, words: int | None = None,
                   registers: int | None = None, prefetch: bool | None = None,
                   fused_sums: bool | None = None) -> None:
    """out = x @ W.T for x [T, K] bf16 (T <= MAX_ROWS) and out [T, N] (rows of any stride). ``registers``: a cap on
    a thread's (Triton's maxnreg; None: the compiler's choice), for probes. ``prefetch``: the kernel's PREFETCH
    (None: ``prefetches(T)``). ``fused_sums``: K splits added in the launch (None: split_tickets.ENABLED)."""
    t, k = x.shape
    n = weight.out_features
    if t > MAX_ROWS or not applies(weight.layout, x.dtype, k):
        raise ValueError(f"quant_gemv_mma takes up to {MAX_ROWS} rows of bf16 x and 4-bit lane layouts")
    lay = weight.layout
    ku = group_units(lay)
    default_words, default_warps, warps_per_sm = tile(t)
    fw, warps = words or default_words, warps or default_warps
    block_n = 8 * fw * warps
    if splits is None:
        splits = split_count(n, k, ku, block_n, warps, warps_per_sm, x.device)
    split_words = cdiv(k // (UNIT * ku), splits) * ku * 4
    splits = cdiv(k // 8, split_words)
    if not x.is_contiguous() or x.storage_offset() % 2:   # read as int32 pairs
        x = x.clone(memory_format=torch.contiguous_format)
    partials = out if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    tickets = split_tickets.launch_tickets(x.device, cdiv(n, block_n), splits, fused_sums, split_tickets.ENABLED)
    _gemv_mma_kernel[(cdiv(n, block_n), splits)](
        x.view(torch.int32), out, partials, partials if tickets is None else tickets, *kernel_tensors(weight),
        n, k, t, out.stride(0), split_words,
        **lay.kernel_args(), KU=ku, W=warps, FW=fw, TG=cdiv(t, 8), STAGES=stages, EVEN_N=n % block_n == 0,
        INTERPRET=bool(triton.knobs.runtime.interpret), EARLY=quant_tiles.EARLY_WEIGHTS,
        PREFETCH=prefetches(t) if prefetch is None else prefetch, FUSED_SUM=tickets is not None,
        SPLITS=splits if tickets is not None else 1, num_warps=warps,
        **({"maxnreg": registers} if registers else {}), **pdl_options(x.device))
    if splits > 1 and tickets is None:
        add_splits(partials, out, splits, n)
