"""``quant_matmul(x, weight)``: ``x @ W.T`` with W a low-bit ``QuantWeight`` (cvllm_cuda/quant_planes.py), read in
its packed planes and dequantized in registers.

Both kernels dequantize a tile [BLOCK_N rows, BLOCK_G groups of 32, words per group, elements per word] with
``_dequantize``: a shift and a mask per element, and the integer made a float without a conversion instruction
(``q | 0x4B000000`` is the float 2**23 + q; subtracting 2**23 is exact), then ``q * scale + offset``. The weights
equal the layout's reference dequantization bit for bit.

- GEMV (one row of x, the batch-1 decode step): a program owns BLOCK_N output features and walks their rows
  BLOCK_G groups at a time, multiplying element-wise into a float32 accumulator of the tile's shape; the one
  reduction is at the end. The weight stream is the cost, so everything else is sized to keep loads in flight.
- GEMM (more rows): each K step dequantizes a [BLOCK_N, BLOCK_G * 32] tile to x's dtype and feeds ``tl.dot``
  with a [BLOCK_M, BLOCK_G * 32] tile of x, accumulating in float32.

Launches allocate only the output and never read a value back to the host: graph-safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

import torch

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.quant_planes import GROUP, QuantWeight

_MAGIC = 0x4B000000   # the bits of 2.0**23: OR-ing an integer below 2**23 into its mantissa gives 2**23 + q


@triton.jit
def _dequantize(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, rows, row_ok, groups, group_ok, NUM_GROUPS,
                LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                HAS_M: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_G, WORDS, PER_WORD]: the weights of ``rows`` x ``groups``; element (n, g, i, s) is
    input feature 32 g + PER_WORD i + s of row n (0 where masked)."""
    WORDS: tl.constexpr = LOW_BITS
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    i = tl.arange(0, WORDS)
    s = tl.arange(0, PER_WORD)
    r = rows.to(tl.int64)[:, None, None]
    g = groups[None, :, None]
    ok = row_ok[:, None, None] & group_ok[None, :, None]
    words = tl.load(low_ptr + r * (NUM_GROUPS * WORDS) + i[None, None, :] * NUM_GROUPS + g, mask=ok, other=0)
    q = (words[:, :, :, None] >> (s * LOW_BITS)[None, None, None, :]) & ((1 << LOW_BITS) - 1)
    if HIGH_BITS > 0:
        HIGH_PER_WORD: tl.constexpr = 32 // HIGH_BITS
        first = i * PER_WORD   # the first element of each low word, within its group
        high = tl.load(high_ptr + r * (NUM_GROUPS * HIGH_BITS) + (first // HIGH_PER_WORD)[None, None, :] * NUM_GROUPS
                       + g, mask=ok, other=0)
        shift = ((first % HIGH_PER_WORD)[:, None] + s[None, :]) * HIGH_BITS   # [WORDS, PER_WORD]
        q = q | (((high[:, :, :, None] >> shift[None, None, :, :]) & ((1 << HIGH_BITS) - 1)) << LOW_BITS)
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    # the factors of each low word's elements (a word never straddles a scale group)
    element = g * 32 + (i * PER_WORD)[None, None, :]          # [1, BLOCK_G, WORDS]
    per_super = NUM_GROUPS * 32 // SUPER_GROUP
    d = tl.load(d_ptr + r * per_super + element // SUPER_GROUP, mask=ok, other=0.0).to(tl.float32)
    if HAS_M:
        m = tl.load(m_ptr + r * per_super + element // SUPER_GROUP, mask=ok, other=0.0).to(tl.float32)
    else:
        m = d
    per_scale = NUM_GROUPS * 32 // SCALE_GROUP
    if A_MODE == 0:
        scale = d
    else:
        a = tl.load(a_ptr + r * per_scale + element // SCALE_GROUP, mask=ok, other=0).to(tl.float32)
        scale = d * a
    if B_MODE == 0:
        offset = m * B_CONST
    elif B_MODE == 1:
        offset = m * (a * B_CONST)
    else:
        b = tl.load(b_ptr + r * per_scale + element // SCALE_GROUP, mask=ok, other=0).to(tl.float32)
        offset = m * (b * B_CONST)
    return qf * scale[:, :, :, None] + offset[:, :, :, None]


@triton.jit
def _gemv_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, NUM_GROUPS,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    WORDS: tl.constexpr = LOW_BITS
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    i = tl.arange(0, WORDS)
    s = tl.arange(0, PER_WORD)
    acc = tl.zeros((BLOCK_N, BLOCK_G, WORDS, PER_WORD), dtype=tl.float32)
    for g0 in range(0, NUM_GROUPS, BLOCK_G):
        groups = g0 + tl.arange(0, BLOCK_G)
        group_ok = groups < NUM_GROUPS
        w = _dequantize(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, rows, row_ok, groups, group_ok, NUM_GROUPS,
                        LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
        cols = groups[:, None, None] * 32 + (i * PER_WORD)[None, :, None] + s[None, None, :]
        x = tl.load(x_ptr + cols, mask=group_ok[:, None, None], other=0.0).to(tl.float32)
        acc += w * x[None, :, :, :]
    total = tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)
    tl.store(out_ptr + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["T"])
def _gemm_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, T, N, NUM_GROUPS, stride_xt,
                 stride_ot,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    BLOCK_K: tl.constexpr = BLOCK_G * 32
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ts = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = ts < T
    x_rows = x_ptr + ts.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, NUM_GROUPS, BLOCK_G):
        groups = g0 + tl.arange(0, BLOCK_G)
        group_ok = groups < NUM_GROUPS
        w = _dequantize(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, rows, row_ok, groups, group_ok, NUM_GROUPS,
                        LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
        cols = g0 * 32 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + cols[None, :], mask=t_ok[:, None] & (cols < NUM_GROUPS * 32)[None, :], other=0.0)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype)
        if UPCAST:   # the same bf16-rounded operands multiplied as float32 (see _upcast)
            acc = tl.dot(x.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
        elif IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    out_ptrs = out_ptr + ts.to(tl.int64)[:, None] * stride_ot + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & row_ok[None, :])


# (BLOCK_N, BLOCK_G, num_warps) of the GEMV and (BLOCK_N, BLOCK_G, num_warps, num_stages) of the GEMM, by low bits;
# set from bench/quant_matmul_sweep.py on the H200
GEMV_CONFIGS = {2: (4, 8, 4), 4: (4, 8, 4), 8: (4, 4, 4)}
GEMM_CONFIGS = {2: (64, 2, 4, 3), 4: (64, 2, 4, 3), 8: (64, 2, 4, 3)}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _upcast(dtype: torch.dtype) -> bool:
    """Triton 3.6's interpreter computes ``tl.dot`` of bfloat16 operands wrongly: there the bf16-rounded tiles are
    multiplied as float32, the same products."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _planes(weight: QuantWeight) -> tuple[torch.Tensor, ...]:
    low = weight.low
    pick = lambda t: low if t is None else t   # noqa: E731  (an unused pointer: any tensor on the device)
    return low, pick(weight.high), weight.d, pick(weight.m), pick(weight.a), pick(weight.b)


def quant_gemv(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None) -> None:
    """out[0] = weight @ x[0] (x and out [1, K] / [1, N], contiguous)."""
    block_n, block_g, warps = config or GEMV_CONFIGS[weight.layout.low_bits]
    n, groups = weight.out_features, weight.in_features // GROUP
    _gemv_kernel[(_cdiv(n, block_n),)](x, out, *_planes(weight), n, groups, **weight.layout.kernel_args(),
                                       BLOCK_N=block_n, BLOCK_G=block_g, num_warps=warps,
                                       **pdl_options(x.device))


def quant_gemm(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None) -> None:
    """out = x @ weight.T for x [T, K] (last dimension contiguous) and out [T, N]."""
    block_n, block_g, warps, stages = config or GEMM_CONFIGS[weight.layout.low_bits]
    t, n, groups = x.shape[0], weight.out_features, weight.in_features // GROUP
    block_m = 16 if t <= 16 else 32 if t <= 32 else 64
    grid = (_cdiv(n, block_n), _cdiv(t, block_m))
    _gemm_kernel[grid](x, out, *_planes(weight), t, n, groups, x.stride(0), out.stride(0),
                       **weight.layout.kernel_args(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_G=block_g,
                       IEEE=x.dtype == torch.float32, UPCAST=_upcast(x.dtype), num_warps=warps, num_stages=stages, **pdl_options(x.device))


def quant_matmul(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T`` for x [T, in_features] (bf16, fp16 or fp32): [T, out_features] in x's dtype, float32 sums."""
    if x.dim() != 2 or x.shape[1] != weight.in_features:
        raise ValueError(f"x must be [T, {weight.in_features}], got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if out is None:
        out = torch.empty((x.shape[0], weight.out_features), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0 or weight.out_features == 0:
        return out
    if x.shape[0] == 1:
        quant_gemv(x, weight, out)
    else:
        quant_gemm(x, weight, out)
    return out
