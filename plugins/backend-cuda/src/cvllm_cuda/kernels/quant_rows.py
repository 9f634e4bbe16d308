"""Rows of a low-bit weight in a float dtype, by index: a quantized token embedding's lookups on the GPU, read from
the same planes its LM head multiplies (a GGUF file's tables, cvllm_gguf/table_method.py), so no float copy of the
table is kept. A row is an output feature of the planes (a column of their [K * bits / 32, N] words): each element
is the layout's reference value (the integer times its scale plus its offset, in float32) rounded once to the
dtype, as ``quant_matmul.dequantize_weight`` gives it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_tiles import kernel_tensors, quant_element, tile
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.quant_planes import QuantWeight

BLOCK_T = 16    # looked-up rows a program
BLOCK_W = 32    # words of K a program


@triton.jit
def _rows_kernel(out_ptr, ids_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, T,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """out [T, K] = rows ``ids`` [T] of the weight; a program takes BLOCK_T ids and BLOCK_W words of K."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = ts < T
    rows = tl.load(ids_ptr + ts, mask=t_ok, other=0)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    word_ok = words < K // PER_WORD
    first, low, high, scale, offset = tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, rows,
                                            t_ok, N, LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE,
                                            B_CONST, HAS_M)
    for S in tl.static_range(PER_WORD):
        w = quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset   # [BLOCK_W, BLOCK_T]
        ptrs = out_ptr + ts.to(tl.int64)[None, :] * K + (first + S)
        tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=word_ok[:, None] & t_ok[None, :])


def quant_rows(weight: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (any shape of indices below out_features, on the weight's device) of the weight, ``[*ids.shape,
    in_features]`` of ``dtype``. Nothing is read back to the host: graph-safe."""
    k = weight.in_features
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), k), dtype=dtype, device=weight.low.device)
    if flat.numel():
        grid = (cdiv(flat.numel(), BLOCK_T), cdiv(k * weight.layout.low_bits // 32, BLOCK_W))
        _rows_kernel[grid](out, flat, *kernel_tensors(weight), weight.out_features, k, flat.numel(),
                           **weight.layout.kernel_args(), BLOCK_T=BLOCK_T, BLOCK_W=BLOCK_W, num_warps=4,
                           **pdl_options(out.device))
    return out.view(*ids.shape, k)
