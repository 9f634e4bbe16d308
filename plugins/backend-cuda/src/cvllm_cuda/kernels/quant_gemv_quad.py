"""A batch-1 int8-activation GEMV over a block-interleaved low plane (an experiment against quant_gemv_int8.py).

Layout: int32 [K / 32, N, LOW_BITS]: the LOW_BITS words that hold one column's 32 inputs of a block are
contiguous (16 bytes for 4-bit, 32 for 8-bit), blocks of consecutive columns follow each other. A thread loads one
column's block with one wide load, adds its ``dp4a`` products in an int32 (one activation scale and, for the
formats whose scale group is 32 or more, one weight scale per block) and converts to float once per 32 weights
instead of once per word. PREFETCH issues the next tile's loads before this tile's arithmetic, so a program keeps
two tiles of weight bytes in flight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_gemv_int8 import _dot4, quantize_activations
from cvllm_cuda.kernels.quant_tiles import add_splits, kernel_tensors, word_factors
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.quant_planes import QuantWeight


def interleave_blocks(low: torch.Tensor, bits: int) -> torch.Tensor:
    """A plane [K * bits / 32, N] -> [K / 32, N, bits] (each column's words of a 32-input block contiguous)."""
    words, n = low.shape
    return low.view(words // bits, bits, n).transpose(1, 2).contiguous()


@triton.jit
def _gemv_quad_kernel(packs_ptr, xd_ptr, xsum_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K,
                      SPLIT_BLOCKS,
                      LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                      SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                      HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                      PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    Q: tl.constexpr = LOW_BITS                 # words per 32-input block
    PHASES: tl.constexpr = 8 // LOW_BITS
    BYTE_MASK: tl.constexpr = 0x0F0F0F0F if LOW_BITS == 4 else 0x03030303 if LOW_BITS == 2 else -1
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    start = tl.program_id(1) * SPLIT_BLOCKS
    num_blocks = tl.minimum(K // 32, start + SPLIT_BLOCKS)
    rows = tl.arange(0, BLOCK_B)
    quads = tl.arange(0, Q)
    offs = (rows[:, None, None] * N + cols[None, :, None]) * Q + quads[None, None, :]    # [BLOCK_B, BLOCK_N, Q]
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    b0 = start
    block_ok = (b0 + rows) < num_blocks
    low = tl.load(low_ptr + b0 * N * Q + offs, mask=block_ok[:, None, None] & col_ok[None, :, None], other=0)
    for b0 in range(start, num_blocks, BLOCK_B):
        blocks = b0 + rows
        block_ok = blocks < num_blocks
        if PREFETCH:
            nxt_ok = (blocks + BLOCK_B) < num_blocks
            low_next = tl.load(low_ptr + (b0 + BLOCK_B) * N * Q + offs,
                               mask=nxt_ok[:, None, None] & col_ok[None, :, None], other=0)
        words = (blocks * Q)[:, None, None] + quads[None, None, :]                      # [BLOCK_B, 1, Q]
        dots = tl.zeros((BLOCK_B, BLOCK_N, Q), dtype=tl.int32)
        for s in tl.static_range(PHASES):
            pack = tl.load(packs_ptr + words * PHASES + s, mask=block_ok[:, None, None], other=0)
            dots = _dot4((low >> (s * LOW_BITS)) & BYTE_MASK, pack + tl.zeros_like(dots), dots, INTERPRET)
        dot = tl.sum(dots, axis=2)                                                        # [BLOCK_B, BLOCK_N]
        ok = block_ok[:, None] & col_ok[None, :]
        scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, (blocks * 32)[:, None], cols[None, :], ok, N,
                                      SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
        x_d = tl.load(xd_ptr + blocks, mask=block_ok, other=0.0)
        x_sum = tl.sum(tl.load(xsum_ptr + (blocks * Q)[:, None] + quads[None, :], mask=block_ok[:, None],
                               other=0.0), axis=1)
        acc += (dot.to(tl.float32) * x_d[:, None]) * scale + offset * x_sum[:, None]
        if PREFETCH:
            low = low_next
        else:
            nxt_ok = (blocks + BLOCK_B) < num_blocks
            low = tl.load(low_ptr + (b0 + BLOCK_B) * N * Q + offs,
                          mask=nxt_ok[:, None, None] & col_ok[None, :, None], other=0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + tl.program_id(1) * N + cols, total.to(out_ptr.dtype.element_ty), mask=col_ok)


def quad_gemv(x: torch.Tensor, weight: QuantWeight, quad_low: torch.Tensor, out: torch.Tensor, block_n: int = 64,
              block_b: int = 4, warps: int = 4, splits: int = 1, prefetch: bool = True) -> None:
    """out[0] = weight @ x[0] with x rounded to int8 per 32 inputs, the low plane read from ``quad_low``
    (interleave_blocks of weight.low). Layouts with a scale group of 32 inputs or more and no high plane."""
    lay = weight.layout
    assert lay.scale_group >= 32 and not lay.high_bits and not lay.float8
    n, k = weight.out_features, weight.in_features
    packs, scales, sums = quantize_activations(x, lay.low_bits)
    blocks = k // 32
    split_blocks = cdiv(cdiv(blocks, splits), block_b) * block_b
    splits = cdiv(blocks, split_blocks)
    target = out if splits == 1 else torch.empty((splits, n), dtype=torch.float32, device=x.device)
    tensors = list(kernel_tensors(weight))
    tensors[0] = quad_low
    _gemv_quad_kernel[(cdiv(n, block_n), splits)](
        packs, scales, sums, target, *tensors, n, k, split_blocks, **lay.kernel_args(), BLOCK_N=block_n,
        BLOCK_B=block_b, PREFETCH=prefetch, INTERPRET=bool(triton.knobs.runtime.interpret), num_warps=warps,
        **pdl_options(x.device))
    if splits > 1:
        add_splits(target, out, splits, n)
