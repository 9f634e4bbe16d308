"""``quant_matmul(x, weight)``: ``x @ W.T`` with W a low-bit ``QuantWeight`` (cvllm_cuda/quant_planes.py: int32
planes [K * bits / 32, N], factors [K / group, N]), dequantized in registers as it is read.

Every path works on tiles of words [BLOCK_W, BLOCK_N] (a word holds 32 / low_bits consecutive input features of one
output feature; consecutive output features are contiguous, so a warp's loads are wide). Element S of every word of
a tile is one shift and mask (plus the high plane's bits), made a float without a conversion instruction
(``q | 0x4B000000`` is the float 2**23 + q; subtracting 2**23 is exact), then scaled per word: ``q * scale +
offset``, the layout's reference values exactly.

- GEMV (one row of x: the batch-1 decode step): each program owns BLOCK_N output features and walks K, summing
  ``q * x`` per word and applying each word's scale once (``scale * sum(q x) + offset * sum(x)``); one reduction
  at the end. When the output features alone make too few programs to fill the GPU (a 4096-row weight is 128
  tiles of 32), K is split over programs too and a second small kernel adds the float32 partial sums.
- GEMM (2 to GEMM_MAX_ROWS rows: decode batches): per element position S one ``tl.dot`` of the x columns
  ``first + S`` with the dequantized tile (the sum over K does not care about the order of its terms), float32
  accumulators, split over K the same way.
- More rows (prefill): one kernel writes W^T in x's dtype, and cuBLAS multiplies.

Measured on the H200 (bench/quant_matmul_sweep.py, docs/benchmarks.md): the float GEMV's arithmetic (about four
instructions per weight) is ~40% of its time, so a Q4_K Llama-3-8B decodes ~1.1x bf16 with it; GGUF layouts
without a high plane take the int8-activation GEMV at batch 1 instead (quant_gemv_int8.py, ~1.4x bf16).

Launches allocate only the output (and the split partial sums) and never read a value back to the host: they are
captured in the decode CUDA graphs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.quant_planes import QuantWeight


@triton.jit
def _load_words(low_ptr, high_ptr, words, cols, ok, N, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr):
    """The low-plane words [BLOCK_W, BLOCK_N] at word indices ``words`` ([BLOCK_W, 1]) of output features ``cols``
    ([1, BLOCK_N]), and for each the high-plane word holding its elements' high bits (``low`` again without one)."""
    low = tl.load(low_ptr + words * N + cols, mask=ok, other=0)
    if HIGH_BITS > 0:
        first = words * (32 // LOW_BITS)
        high = tl.load(high_ptr + first // (32 // HIGH_BITS) * N + cols, mask=ok, other=0)
    else:
        high = low
    return low, high


@triton.jit
def _word_factors(d_ptr, m_ptr, a_ptr, b_ptr, first, cols, ok, N, SCALE_GROUP: tl.constexpr,
                  SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                  HAS_M: tl.constexpr):
    """scale and offset (float32 [BLOCK_W, BLOCK_N]) of the words whose first elements are ``first``
    ([BLOCK_W, 1]): a word never straddles a scale group."""
    d = tl.load(d_ptr + first // SUPER_GROUP * N + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_M:
        m = tl.load(m_ptr + first // SUPER_GROUP * N + cols, mask=ok, other=0.0).to(tl.float32)
    else:
        m = d
    if A_MODE == 0:
        scale = d
        a = d
    else:
        a = tl.load(a_ptr + first // SCALE_GROUP * N + cols, mask=ok, other=0).to(tl.float32)
        scale = d * a
    if B_MODE == 0:
        offset = m * B_CONST
    elif B_MODE == 1:
        offset = m * (a * B_CONST)
    else:
        b = tl.load(b_ptr + first // SCALE_GROUP * N + cols, mask=ok, other=0).to(tl.float32)
        offset = m * (b * B_CONST)
    return scale, offset


@triton.jit
def _tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, cols, col_ok, N,
          LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr,
          A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr, HAS_M: tl.constexpr):
    """A tile's words and factors [BLOCK_W, BLOCK_N] (``words`` [BLOCK_W], ``cols`` [BLOCK_N]), and each word's first
    element [BLOCK_W, 1]: what every kernel here starts a K step with."""
    ok = word_ok[:, None] & col_ok[None, :]
    first = (words * (32 // LOW_BITS))[:, None]
    low, high = _load_words(low_ptr, high_ptr, words[:, None], cols[None, :], ok, N, LOW_BITS, HIGH_BITS)
    scale, offset = _word_factors(d_ptr, m_ptr, a_ptr, b_ptr, first, cols[None, :], ok, N, SCALE_GROUP,
                                  SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
    return first, low, high, scale, offset


@triton.jit
def _quant(low, high, first, S: tl.constexpr, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr,
           FLOAT8: tl.constexpr = False):
    """float32: the integer of element ``first + S`` of each word (exact, without a conversion instruction), or
    its FP8 e4m3 value (FLOAT8)."""
    q = (low >> (S * LOW_BITS)) & ((1 << LOW_BITS) - 1)
    if FLOAT8:
        return q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    if HIGH_BITS > 0:
        shift = (first % (32 // HIGH_BITS) + S) * HIGH_BITS
        q = q | (((high >> shift) & ((1 << HIGH_BITS) - 1)) << LOW_BITS)
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _unit(low, high_at, S: tl.constexpr, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, FLOAT8: tl.constexpr):
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
    v = (moved & (((1 << LOW_BITS) - 1) << top)) | 0x3F800000
    if HIGH_BITS > 0:
        high_shift: tl.constexpr = top + LOW_BITS - S * HIGH_BITS
        if high_shift >= 0:
            high = high_at << high_shift
        else:
            high = high_at >> -high_shift
        v = v | (high & (((1 << HIGH_BITS) - 1) << (top + LOW_BITS)))
    return v.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, SPLIT_WORDS,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 GROUP_WORDS: tl.constexpr, STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (i, j) sums words j * SPLIT_WORDS .. (j + 1) * SPLIT_WORDS of output features i * BLOCK_N ...; with
    more than one split, ``out`` is the float32 [splits, N] of the partial sums (``_sum_splits`` adds them).

    A tile is [BLOCK_W // GROUP_WORDS, GROUP_WORDS, BLOCK_N] words: GROUP_WORDS words share their factors (one
    scale group, or a part of one), loaded once per group and column. Per element: a shift, an or and a fused
    multiply-add of ``1 + q / 2**bits`` with x; per word, ``sum (1 + q/2**bits) x = sum x + sum(q x) / 2**bits``
    turns into the weights' sum with one more multiply-add: ``scale * sum(q x) + offset * sum(x)``."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    GROUPS: tl.constexpr = BLOCK_W // GROUP_WORDS
    UNIT: tl.constexpr = 1.0 if FLOAT8 else float(1 << (LOW_BITS + HIGH_BITS))
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols[None, :] < N
    cols3 = cols[None, None, :]
    start = tl.program_id(1) * SPLIT_WORDS
    num_words = tl.minimum(K // PER_WORD, start + SPLIT_WORDS)
    group_first = tl.arange(0, GROUPS) * GROUP_WORDS                                 # [GROUPS]
    tile_words = group_first[:, None, None] + tl.arange(0, GROUP_WORDS)[None, :, None]   # [GROUPS, GROUP_WORDS, 1]
    acc = tl.zeros((GROUPS, GROUP_WORDS, BLOCK_N), dtype=tl.float32)
    # STAGES > 1: Triton's software pipelining issues the next tiles' loads while this one computes
    for w0 in tl.range(start, num_words, BLOCK_W, num_stages=STAGES):
        words = w0 + tile_words
        word_ok = words < num_words
        ok = word_ok & (cols3 < N)
        low = tl.load(low_ptr + words * N + cols3, mask=ok, other=0)
        high_at = low
        if HIGH_BITS > 0:
            first = words * PER_WORD
            high = tl.load(high_ptr + first // (32 // HIGH_BITS) * N + cols3, mask=ok, other=0)
            high_at = high >> (first % (32 // HIGH_BITS) * HIGH_BITS)
        # each group's factors, at its first word (a word never straddles a scale group)
        gwords = w0 + group_first
        scale, offset = _word_factors(d_ptr, m_ptr, a_ptr, b_ptr, (gwords * PER_WORD)[:, None], cols[None, :],
                                      (gwords < num_words)[:, None] & col_ok, N, SCALE_GROUP, SUPER_GROUP, A_MODE,
                                      B_MODE, B_CONST, HAS_M)
        part = tl.zeros((GROUPS, GROUP_WORDS, BLOCK_N), dtype=tl.float32)
        x_sum = tl.zeros((GROUPS, GROUP_WORDS, 1), dtype=tl.float32)
        for S in tl.static_range(PER_WORD):
            x = tl.load(x_ptr + words * PER_WORD + S, mask=word_ok, other=0.0).to(tl.float32)
            part += _unit(low, high_at, S, LOW_BITS, HIGH_BITS, FLOAT8) * x
            x_sum += x
        # part = sum(x) + sum(q x) / UNIT per word (FP8: sum(q x))
        scaled = (scale * UNIT)[:, None, :]
        if FLOAT8:
            acc += part * scaled + offset[:, None, :] * x_sum
        else:
            acc += part * scaled + (offset[:, None, :] - scaled) * x_sum
    total = tl.sum(tl.sum(acc, axis=1), axis=0)
    tl.store(out_ptr + tl.program_id(1) * N + cols, total.to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _sum_splits(partial_ptr, out_ptr, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(SPLITS):
        total += tl.load(partial_ptr + j * N + cols, mask=ok, other=0.0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T"])
def _gemm_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, T, N, K, stride_xt, stride_ot,
                 SPLIT_WORDS,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """out tile [BLOCK_M, BLOCK_N] += x tile @ W^T tile, one ``tl.dot`` per element position S of the words (the
    sum over K does not care in which order its terms come). Split over K like the GEMV: with more than one split,
    ``out`` is float32 [splits, T, N] (stride_ot N)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ts = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = ts < T
    x_rows = x_ptr + ts.to(tl.int64)[:, None] * stride_xt
    start = tl.program_id(2) * SPLIT_WORDS
    num_words = tl.minimum(K // PER_WORD, start + SPLIT_WORDS)
    out_ptr += tl.program_id(2).to(tl.int64) * T * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for w0 in range(start, num_words, BLOCK_W):
        words = w0 + tl.arange(0, BLOCK_W)
        word_ok = words < num_words
        first, low, high, scale, offset = _tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, cols,
                                                col_ok, N, LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE,
                                                B_MODE, B_CONST, HAS_M)
        for S in tl.static_range(PER_WORD):
            x = tl.load(x_rows + (words * PER_WORD + S)[None, :], mask=t_ok[:, None] & word_ok[None, :], other=0.0)
            w = (_quant(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset).to(x.dtype)
            if UPCAST:   # the same bf16-rounded operands multiplied as float32 (see _upcast)
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(x, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
    out_ptrs = out_ptr + ts.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequantize_kernel(out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K,
                       LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                       SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                       HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """The transposed weight W^T [K, N] in out's dtype (many rows of x: then cuBLAS multiplies)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    word_ok, col_ok = words < K // PER_WORD, cols < N
    first, low, high, scale, offset = _tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, cols,
                                            col_ok, N, LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE,
                                            B_CONST, HAS_M)
    for S in tl.static_range(PER_WORD):
        w = _quant(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset
        ptrs = out_ptr + (first + S).to(tl.int64) * N + cols[None, :]
        tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=word_ok[:, None] & col_ok[None, :])


# (BLOCK_N, BLOCK_W, num_warps[, stages]) of the GEMV, (BLOCK_N, BLOCK_W, num_warps, num_stages) of the GEMM and
# (BLOCK_N, BLOCK_W, num_warps) of the dequantization, by low-plane bits; set from bench/quant_matmul_sweep.py
GEMV_CONFIGS = {2: (32, 32, 4), 4: (32, 32, 4), 8: (32, 32, 4)}
GEMM_CONFIGS = {2: (32, 64, 4, 3), 4: (32, 64, 4, 3), 8: (32, 64, 4, 3)}
DEQUANT_CONFIGS = {2: (256, 8, 4), 4: (256, 8, 4), 8: (128, 4, 4)}
# the GEMV splits K until it has about this many programs per SM
PROGRAMS_PER_SM = 4
# rows of x up to which the dequantize-in-tile GEMM runs; more rows (prefill) dequantize the weight once and call
# cuBLAS. Decode batches stay below it: dequantizing every weight to bf16 each step writes and reads back a bf16
# model per step. 128 is reasoned, not yet measured (the sweep times 64 and 256 rows both ways)
GEMM_MAX_ROWS = 128


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _upcast(dtype: torch.dtype) -> bool:
    """Triton 3.6's interpreter computes ``tl.dot`` of bfloat16 operands wrongly: there the bf16-rounded tiles are
    multiplied as float32, the same products."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _planes(weight: QuantWeight) -> tuple[torch.Tensor, ...]:
    """The kernels' tensor arguments; an absent one is any tensor on the device (an unused pointer). QuantWeight
    checked at construction that int32 indexes them."""
    low = weight.low
    return (low, weight.high if weight.high is not None else low, weight.d, weight.m if weight.m is not None else low,
            weight.a if weight.a is not None else low, weight.b if weight.b is not None else low)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def k_splits(programs: int, k: int, low_bits: int, block_w: int, device: torch.device) -> int:
    """How many parts to split K into: enough programs to fill the GPU about PROGRAMS_PER_SM times over (a 4096-row
    weight in 32-row tiles is 128 programs, fewer than the H200's 132 SMs), each still a few K steps long."""
    if device.type != "cuda":
        return 1 if k < 1024 else 2   # the interpreter: both paths
    steps = _cdiv(k * low_bits // 32, block_w)
    return max(1, min(_cdiv(PROGRAMS_PER_SM * _sm_count(device.index or 0), programs), steps // 4, 16))


def quant_gemv(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
               splits: int | None = None) -> None:
    """out[0] = weight @ x[0] (x [1, K] and out [1, N], contiguous)."""
    block_n, block_w, warps, *stages = config or GEMV_CONFIGS[weight.layout.low_bits]
    n, k = weight.out_features, weight.in_features
    splits, split_words = _split(_cdiv(n, block_n), k, weight.layout.low_bits, block_w, x.device, splits)
    target = out if splits == 1 else torch.empty((splits, n), dtype=torch.float32, device=x.device)
    _gemv_kernel[(_cdiv(n, block_n), splits)](x, target, *_planes(weight), n, k, split_words,
                                              **weight.layout.kernel_args(), BLOCK_N=block_n, BLOCK_W=block_w,
                                              GROUP_WORDS=group_words(weight.layout, block_w),
                                              STAGES=stages[0] if stages else 1, num_warps=warps,
                                              **pdl_options(x.device))
    if splits > 1:
        _add_splits(target, out, splits, n)


def group_words(layout, block_w: int) -> int:
    """Words of a GEMV tile that share factors: a scale group's words when whole groups fit a tile, the tile when it
    fits in a group, else 1 (factors per word)."""
    words = layout.scale_group * layout.low_bits // 32
    if block_w % words == 0:
        return words
    return block_w if words % block_w == 0 else 1


def _split(programs: int, k: int, low_bits: int, block_w: int, device: torch.device,
           splits: int | None) -> tuple[int, int]:
    """(splits, words per split), the words a whole number of K steps."""
    words = k * low_bits // 32
    if splits is None:
        splits = k_splits(programs, k, low_bits, block_w, device)
    split_words = _cdiv(_cdiv(words, splits), block_w) * block_w
    return _cdiv(words, split_words), split_words


def _add_splits(partials: torch.Tensor, out: torch.Tensor, splits: int, n: int) -> None:
    """out [T, N] (rows of any stride) = the sum of partials [splits, T, N] (float32)."""
    t = out.shape[0] if out.dim() == 2 else 1
    target = out if out.is_contiguous() else torch.empty((t, n), dtype=out.dtype, device=out.device)
    _sum_splits[(_cdiv(t * n, 1024),)](partials, target, t * n, SPLITS=splits, BLOCK=1024, num_warps=4,
                                       **pdl_options(out.device))
    if target is not out:
        out.copy_(target)


def quant_gemm(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
               splits: int | None = None) -> None:
    """out = x @ weight.T for x [T, K] (last dimension contiguous) and out [T, N] (last dimension contiguous).
    ``config``: (BLOCK_N, BLOCK_W, num_warps, num_stages[, BLOCK_M])."""
    block_n, block_w, warps, stages, *block_m = config or GEMM_CONFIGS[weight.layout.low_bits]
    t, n, k = x.shape[0], weight.out_features, weight.in_features
    block_m = block_m[0] if block_m else 16 if t <= 16 else 32 if t <= 32 else 64 if t <= 64 else 128
    programs = _cdiv(n, block_n) * _cdiv(t, block_m)
    splits, split_words = _split(programs, k, weight.layout.low_bits, block_w, x.device, splits)
    target = out if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    grid = (_cdiv(n, block_n), _cdiv(t, block_m), splits)
    _gemm_kernel[grid](x, target, *_planes(weight), t, n, k, x.stride(0), target.stride(-2), split_words,
                       **weight.layout.kernel_args(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w,
                       IEEE=x.dtype == torch.float32, UPCAST=_upcast(x.dtype), num_warps=warps, num_stages=stages,
                       **pdl_options(x.device))
    if splits > 1:
        _add_splits(target, out, splits, n)


def dequantize_weight(weight: QuantWeight, dtype: torch.dtype, config: tuple | None = None) -> torch.Tensor:
    """The weight transposed, W^T [K, N] of ``dtype`` (the layout's reference values, rounded once to ``dtype``)."""
    block_n, block_w, warps = config or DEQUANT_CONFIGS[weight.layout.low_bits]
    n, k = weight.out_features, weight.in_features
    out = torch.empty((k, n), dtype=dtype, device=weight.low.device)
    grid = (_cdiv(n, block_n), _cdiv(k * weight.layout.low_bits // 32, block_w))
    _dequantize_kernel[grid](out, *_planes(weight), n, k, **weight.layout.kernel_args(), BLOCK_N=block_n,
                             BLOCK_W=block_w, num_warps=warps, **pdl_options(out.device))
    return out


def quant_matmul(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for x [T, in_features] (bf16, fp16 or fp32): [T, out_features] in x's dtype, float32 sums."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [T, {weight.in_features}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    t = x.shape[0]
    if t > GEMM_MAX_ROWS and out is None:
        return x @ dequantize_weight(weight, x.dtype)
    if out is None:
        out = torch.empty((t, weight.out_features), dtype=x.dtype, device=x.device)
    if t == 0 or weight.out_features == 0:
        return out
    if t == 1:
        from cvllm_cuda.kernels import quant_gemv_int8  # (it builds on this module)
        if quant_gemv_int8.applies(weight.layout, weight.in_features):
            quant_gemv_int8.quant_gemv_int8(x, weight, out)
        else:
            quant_gemv(x, weight, out)
    elif t <= GEMM_MAX_ROWS:
        quant_gemm(x, weight, out)
    else:
        torch.matmul(x, dequantize_weight(weight, x.dtype), out=out)
    return out


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer's forward over a ``QuantWeight``: x [..., in_features] -> [..., out_features] in x's dtype,
    plus ``bias``."""
    out = quant_matmul(x.reshape(-1, weight.in_features), weight)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.view(*x.shape[:-1], weight.out_features)

