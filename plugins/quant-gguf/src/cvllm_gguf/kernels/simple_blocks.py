"""Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 matmuls over the blocks as the file stores them.

All five are blocks of 32 elements: an f16 scale d (and, for the ``_1`` types, an f16 minimum m), then the quants.
Element j (0..31) of a block:

- Q8_0 (34 bytes): ``d * q``, q the int8 at byte 2 + j;
- Q4_0 (18 bytes): ``d * (q - 8)``, q the low nibble of byte 2 + j for j < 16, the high nibble of byte 2 + j - 16
  for j >= 16;
- Q4_1 (20 bytes): ``d * q + m``, the nibbles at byte 4 on;
- Q5_0 (22 bytes): ``d * (q - 16)``, the nibble (bytes 6..21) plus bit 4 from bit j of the little-endian 32-bit
  mask at bytes 2..5, i.e. bit j % 8 of byte 2 + j // 8;
- Q5_1 (24 bytes): ``d * q + m``, the mask at bytes 4..7, the nibbles at byte 8 on.

Every block size here is even, so the kernels read the blocks as 16-bit words (an int16 view of the same bytes):
``_load_blocks`` loads a tile of BLOCK_N rows x BLOCKS_K blocks, per block d (and m) as f16 bit patterns, the
fifth-bit mask as two words, and the quants as NUM_WORDS words (16 for Q8_0, 8 for the 4/5-bit types), each
word one 16-bit load rather than a load per element. A word holds the quants of 2 elements (Q8_0: its two bytes,
elements 2i and 2i + 1) or 4 (4/5-bit: the low nibbles of bytes 2i and 2i + 1, elements 2i and 2i + 1, and their
high nibbles, elements 16 + 2i and 17 + 2i). ``_plane`` extracts one of those 2 or 4 "planes" from every word
and dequantizes it: float32 [BLOCK_N, BLOCKS_K * NUM_WORDS], whose column (block b, word i) is input feature
32 b + first + 2i (``_plane_columns``); the x tile is gathered at the same features, so each plane is a plain
product with no shuffle of the weights. The values are those of ``dequant.py``: the same float32 operations on
the same f16 scales (d * q is exact in float32, so even a fused d * q + m rounds the same).

- GEMV (``_gemv_kernel``, up to GEMV_MAX_ROWS rows of x): grid ``cdiv(N, BLOCK_N)``; a program walks the whole
  row of blocks of its BLOCK_N output features, BLOCKS_K blocks a step, and multiplies each plane with all T
  rows of x at once (``[BLOCK_T, 1, K'] * [1, BLOCK_N, K']`` summed over K' into a [BLOCK_T, BLOCK_N] fp32
  accumulator), so the weight is streamed once whatever T.
- GEMM (``_gemm_kernel``): grid ``(cdiv(N, BLOCK_N), cdiv(T, BLOCK_M))``; each K step loads a [BLOCK_N, BLOCKS_K]
  tile of blocks, and each plane, converted to x's dtype (float32 stays float32, multiplied in IEEE precision,
  not TF32), is accumulated with ``tl.dot(x plane columns, plane.T)`` in fp32.

K is always whole blocks; a K that is not a multiple of the step is masked block by block. Tile sizes are
reasonable defaults, not yet timed on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cvllm_gguf.kernels import register
from cvllm_gguf.quant_types import FORMATS, GGMLType

try:  # programmatic dependent launch, as the CUDA backend's kernels use it (that plugin is optional here)
    from cvllm_cuda.kernels.pdl import options as _pdl_options
    from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
except ImportError:  # pragma: no cover - without cvllm-cuda: ordinary launches
    _NO_PDL = {"USE_PDL": False}

    def _pdl_options(device: torch.device) -> dict:
        return _NO_PDL

    @triton.jit
    def wait_for_previous_kernel(USE_PDL: tl.constexpr):
        pass


QK = 32  # elements per block


@dataclass(frozen=True, slots=True)
class SimpleLayout:
    type_size: int   # bytes per block
    quant_offset: int  # first byte of the quants
    high_offset: int  # first byte of the 32-bit mask of fifth bits; 0: none
    has_min: bool    # an f16 minimum at bytes 2..3 (added), else a fixed zero point (subtracted)
    bits: int        # 4, 5 or 8
    zero: int        # subtracted from q before the scale (types without a minimum)


LAYOUTS: dict[GGMLType, SimpleLayout] = {
    GGMLType.Q8_0: SimpleLayout(34, 2, 0, False, 8, 0),
    GGMLType.Q4_0: SimpleLayout(18, 2, 0, False, 4, 8),
    GGMLType.Q4_1: SimpleLayout(20, 4, 0, True, 4, 0),
    GGMLType.Q5_0: SimpleLayout(22, 6, 2, False, 5, 16),
    GGMLType.Q5_1: SimpleLayout(24, 8, 4, True, 5, 0),
}
for _qtype, _layout in LAYOUTS.items():
    assert FORMATS[_qtype].type_size == _layout.type_size and FORMATS[_qtype].block_size == QK


@triton.jit
def _load_blocks(w_ptr, rows, row_ok, blocks, block_ok, ROW_WORDS,
                 TYPE_SIZE: tl.constexpr, QUANT_OFFSET: tl.constexpr, HIGH_OFFSET: tl.constexpr,
                 HAS_MIN: tl.constexpr, BITS: tl.constexpr, NUM_WORDS: tl.constexpr):
    """The 16-bit words of a tile of ``rows`` x ``blocks`` (``w_ptr``: the blocks as int16): the quants as int32
    [BLOCK_N, BLOCKS_K, NUM_WORDS] (0..65535), d and m as float32 [BLOCK_N, BLOCKS_K, 1], the fifth-bit mask as
    int32 [BLOCK_N, BLOCKS_K, 1] (0 where masked; m and the mask 0 for types without them)."""
    base = rows.to(tl.int64)[:, None] * ROW_WORDS + blocks[None, :] * (TYPE_SIZE // 2)  # [BLOCK_N, BLOCKS_K]
    ok = row_ok[:, None] & block_ok[None, :]
    i = tl.arange(0, NUM_WORDS)
    words = tl.load(w_ptr + base[:, :, None] + QUANT_OFFSET // 2 + i[None, None, :], mask=ok[:, :, None], other=0)
    words = words.to(tl.int32) & 0xFFFF
    d = tl.load(w_ptr + base, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    if HAS_MIN:
        m = tl.load(w_ptr + base + 1, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
    else:
        m = tl.zeros_like(d)
    if BITS == 5:
        low = tl.load(w_ptr + base + HIGH_OFFSET // 2, mask=ok, other=0).to(tl.int32) & 0xFFFF
        high = tl.load(w_ptr + base + HIGH_OFFSET // 2 + 1, mask=ok, other=0).to(tl.int32) & 0xFFFF
        fifth = (low | (high << 16))[:, :, None]
    else:
        fifth = tl.zeros_like(d).to(tl.int32)
    return words, d, m, fifth


@triton.jit
def _plane_column(PLANE: tl.constexpr, BITS: tl.constexpr):
    """The element (within its block) of word 0 in plane PLANE; word i's is this + 2 i."""
    if BITS == 8:
        return PLANE
    else:
        return 16 * (PLANE // 2) + PLANE % 2


@triton.jit
def _plane(words, d, m, fifth, PLANE: tl.constexpr, HAS_MIN: tl.constexpr, BITS: tl.constexpr,
           ZERO: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_K: tl.constexpr, NUM_WORDS: tl.constexpr):
    """float32 [BLOCK_N, BLOCKS_K * NUM_WORDS]: the weights of plane PLANE, i.e. elements _plane_column + 2 i."""
    if BITS == 8:  # byte PLANE of each word, as int8
        q = (((words >> (8 * PLANE)) & 0xFF) ^ 128) - 128
    else:  # nibble PLANE // 2 of byte PLANE % 2
        q = (words >> (8 * (PLANE % 2) + 4 * (PLANE // 2))) & 15
        if BITS == 5:
            j = _plane_column(PLANE, BITS) + 2 * tl.arange(0, NUM_WORDS)
            q = q | (((fifth >> j[None, None, :]) & 1) << 4)
    if HAS_MIN:
        w = d * q.to(tl.float32) + m
    else:
        w = d * (q - ZERO).to(tl.float32)
    return tl.reshape(w, (BLOCK_N, BLOCKS_K * NUM_WORDS))


@triton.jit
def _plane_columns(blocks, PLANE: tl.constexpr, BITS: tl.constexpr, BLOCKS_K: tl.constexpr,
                   NUM_WORDS: tl.constexpr):
    """The input features of _plane's columns: [BLOCKS_K * NUM_WORDS]."""
    j = _plane_column(PLANE, BITS) + 2 * tl.arange(0, NUM_WORDS)
    return tl.reshape(blocks[:, None] * 32 + j[None, :], (BLOCKS_K * NUM_WORDS,))


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, T, N, NUM_BLOCKS, ROW_WORDS, stride_xt, stride_ot,
    TYPE_SIZE: tl.constexpr, QUANT_OFFSET: tl.constexpr, HIGH_OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
    BITS: tl.constexpr, ZERO: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    NUM_WORDS: tl.constexpr = 16 if BITS == 8 else 8
    NUM_PLANES: tl.constexpr = 2 if BITS == 8 else 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ts = tl.arange(0, BLOCK_T)
    t_ok = ts < T
    x_rows = x_ptr + ts[:, None] * stride_xt
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, NUM_BLOCKS, BLOCKS_K):
        blocks = b0 + tl.arange(0, BLOCKS_K)
        words, d, m, fifth = _load_blocks(w_ptr, rows, row_ok, blocks, blocks < NUM_BLOCKS, ROW_WORDS, TYPE_SIZE,
                                          QUANT_OFFSET, HIGH_OFFSET, HAS_MIN, BITS, NUM_WORDS)
        for plane in tl.static_range(NUM_PLANES):
            w = _plane(words, d, m, fifth, plane, HAS_MIN, BITS, ZERO, BLOCK_N, BLOCKS_K, NUM_WORDS)
            cols = _plane_columns(blocks, plane, BITS, BLOCKS_K, NUM_WORDS)
            x = tl.load(x_rows + cols[None, :], mask=t_ok[:, None] & (cols < NUM_BLOCKS * 32)[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
    out_ptrs = out_ptr + ts[:, None] * stride_ot + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, T, N, NUM_BLOCKS, ROW_WORDS, stride_xt, stride_ot,
    TYPE_SIZE: tl.constexpr, QUANT_OFFSET: tl.constexpr, HIGH_OFFSET: tl.constexpr, HAS_MIN: tl.constexpr,
    BITS: tl.constexpr, ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    NUM_WORDS: tl.constexpr = 16 if BITS == 8 else 8
    NUM_PLANES: tl.constexpr = 2 if BITS == 8 else 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ts = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = ts < T
    x_rows = x_ptr + ts.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, NUM_BLOCKS, BLOCKS_K):
        blocks = b0 + tl.arange(0, BLOCKS_K)
        words, d, m, fifth = _load_blocks(w_ptr, rows, row_ok, blocks, blocks < NUM_BLOCKS, ROW_WORDS, TYPE_SIZE,
                                          QUANT_OFFSET, HIGH_OFFSET, HAS_MIN, BITS, NUM_WORDS)
        for plane in tl.static_range(NUM_PLANES):
            w = _plane(words, d, m, fifth, plane, HAS_MIN, BITS, ZERO, BLOCK_N, BLOCKS_K, NUM_WORDS)
            cols = _plane_columns(blocks, plane, BITS, BLOCKS_K, NUM_WORDS)
            x = tl.load(x_rows + cols[None, :], mask=t_ok[:, None] & (cols < NUM_BLOCKS * 32)[None, :], other=0.0)
            w_t = tl.trans(w.to(x.dtype))
            if UPCAST:  # the same products, in float32 (see _upcast)
                acc = tl.dot(x.to(tl.float32), w_t.to(tl.float32), acc, input_precision="ieee")
            elif IEEE:
                acc = tl.dot(x, w_t, acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w_t, acc)
    out_ptrs = out_ptr + ts.to(tl.int64)[:, None] * stride_ot + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & row_ok[None, :])


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# GEMV: 4 output features x 8 blocks (256 columns) a step; GEMM: 64 x 64 output tiles (16/32 rows for fewer
# rows of x), 4 blocks (128 columns) a step, 2 for float32 x. Defaults, not yet timed on a GPU. Register use, from
# ptxas for sm_90a (Triton's ahead-of-time compile, no GPU needed), no spills: GEMV 40-72 registers; GEMM 60-128
# (bf16), 75-169 (fp32, which spilled with 4 blocks a step).
GEMV_BLOCK_N, GEMV_BLOCKS_K, GEMV_WARPS = 4, 8, 4
GEMM_BLOCK_N, GEMM_BLOCKS_K, GEMM_BLOCKS_K_FP32, GEMM_WARPS, GEMM_STAGES = 64, 4, 2, 8, 2


def _upcast(dtype: torch.dtype) -> bool:
    """Triton 3.6's interpreter computes ``tl.dot`` of bfloat16 operands wrongly (garbage of ~1e9, even for
    loaded operands): there the bf16-rounded tiles are multiplied as float32, the same products."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _layout_args(layout: SimpleLayout) -> dict:
    return {"TYPE_SIZE": layout.type_size, "QUANT_OFFSET": layout.quant_offset, "HIGH_OFFSET": layout.high_offset,
            "HAS_MIN": layout.has_min, "BITS": layout.bits, "ZERO": layout.zero}


def _launchers(qtype: GGMLType):
    layout_args = _layout_args(LAYOUTS[qtype])

    def gemv(x: torch.Tensor, qweight: torch.Tensor, out_features: int, in_features: int, out: torch.Tensor) -> None:
        t = x.shape[0]
        _gemv_kernel[(_cdiv(out_features, GEMV_BLOCK_N),)](
            x, qweight.view(torch.int16), out, t, out_features, in_features // QK, qweight.shape[1] // 2,
            x.stride(0), out.stride(0), **layout_args,
            BLOCK_T=_next_power_of_2(t), BLOCK_N=GEMV_BLOCK_N, BLOCKS_K=GEMV_BLOCKS_K,
            num_warps=GEMV_WARPS, **_pdl_options(x.device),
        )

    def gemm(x: torch.Tensor, qweight: torch.Tensor, out_features: int, in_features: int, out: torch.Tensor) -> None:
        t = x.shape[0]
        block_m = 16 if t <= 16 else 32 if t <= 32 else 64
        grid = (_cdiv(out_features, GEMM_BLOCK_N), _cdiv(t, block_m))
        _gemm_kernel[grid](
            x, qweight.view(torch.int16), out, t, out_features, in_features // QK, qweight.shape[1] // 2,
            x.stride(0), out.stride(0), **layout_args,
            BLOCK_M=block_m, BLOCK_N=GEMM_BLOCK_N, IEEE=x.dtype == torch.float32,
            BLOCKS_K=GEMM_BLOCKS_K_FP32 if x.dtype == torch.float32 else GEMM_BLOCKS_K,
            UPCAST=_upcast(x.dtype), num_warps=GEMM_WARPS, num_stages=GEMM_STAGES, **_pdl_options(x.device),
        )

    return gemv, gemm


for _qtype in LAYOUTS:
    register(_qtype, *_launchers(_qtype))
