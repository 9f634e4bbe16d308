"""``quant_matmul(x, weight)``: ``x @ W.T`` with W a low-bit ``QuantWeight`` (cvllm_cuda/quant_planes.py: int32
planes [K * bits / 32, N], factors [K / group, N]), dequantized in registers as it is read (quant_tiles.py).

- One row of x (the batch-1 decode step): the GEMV, quant_gemv_int8.py where the layout allows llama.cpp's int8
  activations (up to its MAX_ROWS rows: each row's output then is what it would be alone, so a speculative verify
  step's rows round as the plain steps do); else the tensor-core GEMV (quant_gemv_mma.py) for bf16 x times a 4-bit
  weight without a high plane (GPTQ/AWQ), up to quant_gemv_mma.ROUTED_ROWS rows; else quant_gemv.py.
- The other rows up to GEMM_MAX_ROWS (decode batches, speculative verify steps): a K step's words unpacked into one
  tile [BLOCK_K, BLOCK_N] in order, one ``tl.dot`` with a contiguous x tile, float32 accumulators, split over K like the
  GEMV. (The older per-position kernel, a ``tl.dot`` per element position S of the words with the x columns
  ``first + S``, stays for a tile that does not fit.) Up to SWAPPED_MAX_ROWS rows, 4-bit layouts without a high
  plane with bf16 x take the swapped GEMM instead (quant_gemm_swapped.py: the weight unpacked two a lane in bf16,
  as the MMA's register operand), ~20-30% faster there.
- More rows (prefill): one kernel writes W^T in x's dtype, and cuBLAS multiplies.

Launches allocate only the output (and the split partial sums) and never read a value back to the host: they are
captured in the decode CUDA graphs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_gemm_swapped import in_lanes, quant_gemm_swapped
from cvllm_cuda.kernels.quant_gemv import GEMV_CONFIGS, quant_gemv
from cvllm_cuda.kernels.quant_tiles import (
    add_splits,
    dot_into,
    dot_unpacked,
    kernel_tensors,
    quant_element,
    row_tile,
    run_or_fall_back,
    split_k,
    tile,
    upcast,
)
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.quant_planes import QuantWeight

__all__ = ["DEQUANT_CONFIGS", "GEMM_CONFIGS", "GEMM_MAX_ROWS", "GEMV_CONFIGS", "PER_POSITION_CONFIGS",
           "dequantize_weight", "quant_gemm", "quant_gemv", "quant_linear", "quant_matmul"]


@triton.jit(do_not_specialize=["T"])
def _gemm_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, T, N, K, stride_xt, stride_ot,
                 SPLIT_WORDS,
                 LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                 SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                 HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_W: tl.constexpr, UNPACKED: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """out tile [BLOCK_M, BLOCK_N] += x tile @ W^T tile over K steps of BLOCK_W words. UNPACKED: the words
    [BLOCK_W, BLOCK_N] broadcast against their element positions and reshaped into one tile [BLOCK_K, BLOCK_N] in
    order, one ``tl.dot`` with a contiguous x tile a step. Else one ``tl.dot`` per element position S of the words,
    x read at a stride (the sum over K does not care in which order its terms come). Split over K like the GEMV:
    with more than one split, ``out`` is float32 [splits, T, N] (stride_ot N)."""
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
        first, low, high, scale, offset = tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, cols,
                                                col_ok, N, LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE,
                                                B_MODE, B_CONST, HAS_M)
        if UNPACKED:
            ks = w0 * PER_WORD + tl.arange(0, BLOCK_W * PER_WORD)
            x = tl.load(x_rows + ks[None, :], mask=t_ok[:, None] & (ks < num_words * PER_WORD)[None, :], other=0.0)
            acc = dot_unpacked(x, low, high, first, scale, offset, acc, LOW_BITS, HIGH_BITS, FLOAT8, IEEE, UPCAST)
        else:
            for S in tl.static_range(PER_WORD):
                x = tl.load(x_rows + (words * PER_WORD + S)[None, :], mask=t_ok[:, None] & word_ok[None, :],
                            other=0.0)
                w = (quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset).to(x.dtype)
                acc = dot_into(x, w, acc, IEEE, UPCAST)
    out_ptrs = out_ptr + ts.to(tl.int64)[:, None] * stride_ot + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & col_ok[None, :])


@triton.jit
def _dequantize_kernel(out_ptr, ids_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, T, stride_ok, stride_ot,
                       LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                       SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                       HAS_M: tl.constexpr, FLOAT8: tl.constexpr, HAS_IDS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_W: tl.constexpr, USE_PDL: tl.constexpr):
    """The weight's values in out's dtype, element k of output feature n at ``k * stride_ok + t * stride_ot``: every
    feature (t = n, T = N: W^T [K, N] for cuBLAS, many rows of x), or HAS_IDS the T features ``ids`` (t the index
    into them: rows [T, K] of a quantized embedding's lookups)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    ts = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = ts < T
    cols = tl.load(ids_ptr + ts, mask=t_ok, other=0) if HAS_IDS else ts
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    word_ok = words < K // PER_WORD
    first, low, high, scale, offset = tile(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, words, word_ok, cols,
                                            t_ok, N, LOW_BITS, HIGH_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE,
                                            B_CONST, HAS_M)
    for S in tl.static_range(PER_WORD):
        w = quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset
        ptrs = out_ptr + (first + S).to(tl.int64) * stride_ok + ts.to(tl.int64)[None, :] * stride_ot
        tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=word_ok[:, None] & t_ok[None, :])


# (BLOCK_N, BLOCK_W, num_warps, num_stages) of the GEMM, by low-plane bits: the unpacked kernel, a K step of 64
# elements at every width. 4-bit: the fastest of bench/quant_gemm_rows.py's tiles at 4, 64 and 128 rows on the H200
# (q4_k); 2- and 8-bit take the same step and tile, not yet timed
GEMM_CONFIGS = {2: (128, 4, 4, 4), 4: (128, 8, 4, 4), 8: (128, 16, 4, 4)}
# the per-position kernel's (a tl.dot per element position of the words, x read at a stride): 8x slower than the
# unpacked one at 64 rows and 17x at 128, kept for a layout and row tile the unpacked tile does not fit (out of shared
# memory; quant_tiles.run_or_fall_back, logged once)
PER_POSITION_CONFIGS = {2: (32, 64, 4, 3), 4: (32, 64, 4, 3), 8: (32, 64, 4, 3)}
# (BLOCK_N, BLOCK_W, num_warps) of the dequantization, set from bench/quant_matmul_sweep.py
DEQUANT_CONFIGS = {2: (256, 8, 4), 4: (256, 8, 4), 8: (128, 4, 4)}
# rows of x up to which the dequantize-in-tile GEMM runs; more rows (prefill) dequantize the weight once and call
# cuBLAS. Decode batches stay below it: dequantizing every weight to bf16 each step writes and reads back a bf16
# model per step. 128 is reasoned, not yet measured end to end
GEMM_MAX_ROWS = 128
# the decode-batch GEMM unless a call names one: "auto" (swapped_applies), "unpacked" or "swapped" (every layout)
DEFAULT_GEMM = os.environ.get("CVLLM_QUANT_GEMM", "auto")
# rows up to which "auto" takes the swapped GEMM for lane-order layouts (4-bit without a high plane, bf16 x). On the
# H200, a Llama-3-8B layer's four GEMMs (bench/results/2026-12-04-h200-gemm_swapped_probe-tiles-5c9bebb.json), us:
# q4_k 125 / 125 / 127 / 138 / 168 against the unpacked GEMM's 162 / 163 / 168 / 193 / 198 at 2 / 8 / 16 / 32 / 48
# rows, gptq4_g128 111 / 112 / 114 / 128 / 161 against 145 / 147 / 151 / 184 / 172; at 64 rows with that tile,
# (64, 8, 4, 4), q4_k 174 vs 198, gptq 164 vs 179 (...-gemm_swapped_probe-wide-6ca7c93.json: wider weight tiles lost
# at 32-64 rows); at 128 slower (303 vs 277, 8a7a175's tiles)
SWAPPED_MAX_ROWS = 64


def default_gemm(x: torch.Tensor, weight: QuantWeight) -> str:
    """The GEMM a call that names none takes (DEFAULT_GEMM)."""
    if DEFAULT_GEMM != "auto":
        return DEFAULT_GEMM
    return "swapped" if x.shape[0] <= SWAPPED_MAX_ROWS and in_lanes(weight.layout, x.dtype) else "unpacked"


def quant_gemm(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None = None,
               splits: int | None = None, kernel: str | None = None) -> None:
    """out = x @ weight.T for x [T, K] (last dimension contiguous) and out [T, N] (last dimension contiguous).
    ``config``: (BLOCK_N, BLOCK_W, num_warps, num_stages[, BLOCK_M]) of ``kernel`` ("unpacked", "per-position" or
    "swapped": quant_gemm_swapped.py; None: default_gemm)."""
    kernel = kernel or default_gemm(x, weight)

    def run(config):
        if kernel == "swapped":
            quant_gemm_swapped(x, weight, out, config, splits)
        else:
            _gemm(x, weight, out, config, splits, kernel)

    if config is not None or kernel == "per-position":
        run(config)
        return
    run_or_fall_back((kernel, weight.layout, row_tile(x.shape[0])), lambda: run(None),
                     lambda: _gemm(x, weight, out, None, splits, "per-position"))


def _gemm(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, config: tuple | None, splits: int | None,
          kernel: str) -> None:
    assert kernel in ("unpacked", "per-position"), kernel
    unpacked = kernel == "unpacked"
    configs = GEMM_CONFIGS if unpacked else PER_POSITION_CONFIGS
    block_n, block_w, warps, stages, *block_m = config or configs[weight.layout.low_bits]
    t, n, k = x.shape[0], weight.out_features, weight.in_features
    block_m = block_m[0] if block_m else row_tile(t)
    programs = cdiv(n, block_n) * cdiv(t, block_m)
    splits, split_words = split_k(programs, k, weight.layout.low_bits, block_w, x.device, splits)
    target = out if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    grid = (cdiv(n, block_n), cdiv(t, block_m), splits)
    _gemm_kernel[grid](
        x, target, *kernel_tensors(weight), t, n, k, x.stride(0), target.stride(-2), split_words,
        **weight.layout.kernel_args(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w, UNPACKED=unpacked,
        IEEE=x.dtype == torch.float32, UPCAST=upcast(x.dtype), num_warps=warps, num_stages=stages,
        **pdl_options(x.device))
    if splits > 1:
        add_splits(target, out, splits, n)


def dequantize_weight(weight: QuantWeight, dtype: torch.dtype, config: tuple | None = None) -> torch.Tensor:
    """The weight transposed, W^T [K, N] of ``dtype`` (the layout's reference values, rounded once to ``dtype``)."""
    block_n, block_w, warps = config or DEQUANT_CONFIGS[weight.layout.low_bits]
    n, k = weight.out_features, weight.in_features
    out = torch.empty((k, n), dtype=dtype, device=weight.low.device)
    grid = (cdiv(n, block_n), cdiv(k * weight.layout.low_bits // 32, block_w))
    _dequantize_kernel[grid](out, out, *kernel_tensors(weight), n, k, n, n, 1, **weight.layout.kernel_args(),
                             HAS_IDS=False, BLOCK_N=block_n, BLOCK_W=block_w, num_warps=warps,
                             **pdl_options(out.device))
    return out


def dequantize_rows(weight: QuantWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (indices below out_features, any shape, on the weight's device) of the weight, ``[*ids.shape,
    in_features]`` of ``dtype``, each element as ``dequantize_weight`` gives it: a quantized token embedding's
    lookups on the GPU (cvllm_gguf/table_method.py), graph-safe (nothing read back to the host)."""
    k = weight.in_features
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), k), dtype=dtype, device=weight.low.device)
    if flat.numel():
        block_n, block_w, warps = DEQUANT_CONFIGS[weight.layout.low_bits]
        block_n = min(block_n, triton.next_power_of_2(flat.numel()))   # a decode step looks up a row or a few
        grid = (cdiv(flat.numel(), block_n), cdiv(k * weight.layout.low_bits // 32, block_w))
        _dequantize_kernel[grid](out, flat, *kernel_tensors(weight), weight.out_features, k, flat.numel(), 1, k,
                                 **weight.layout.kernel_args(), HAS_IDS=True, BLOCK_N=block_n, BLOCK_W=block_w,
                                 num_warps=warps, **pdl_options(out.device))
    return out.view(*ids.shape, k)


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
    from cvllm_cuda.kernels import quant_gemv_int8, quant_gemv_mma  # (they build on this module)
    if t <= quant_gemv_int8.MAX_ROWS and quant_gemv_int8.applies(weight.layout, weight.in_features):
        quant_gemv_int8.quant_gemv_int8(x, weight, out)
    elif (quant_gemv_mma.ENABLED and t <= quant_gemv_mma.ROUTED_ROWS
          and quant_gemv_mma.applies(weight.layout, x.dtype, weight.in_features)):
        quant_gemv_mma.quant_gemv_mma(x, weight, out)
    elif t == 1:
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
