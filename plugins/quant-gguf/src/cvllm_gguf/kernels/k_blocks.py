"""Triton matmuls over GGUF K-quant blocks read in place: Q4_K, Q5_K, Q6_K, Q2_K, Q3_K.

``out[T, N] = x[T, K] @ W.T`` where W is the ``qweight`` uint8 [N, row_bytes] exactly as the file stores it:
each row is K / 256 super-blocks of 256 values back to back. Nothing is dequantized ahead of time; each
program decodes the blocks it reads in registers. The layouts follow the CPU decoders of dequant.py (the
oracle of the tests); per super-block:

- Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
  nibbles (bytes 32g..32g+31 hold sub-block 2g in their low nibbles, 2g+1 in their high ones);
  value = (d * sc) * q - dmin * m.
- Q5_K (176): as Q4_K, plus 32 bytes of fifth bits (bit j of byte l: value l of sub-block j) before the nibbles.
- Q6_K (210): 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (sub-blocks of 16), f16 d;
  value = (d * sc) * (q - 32).
- Q2_K (84): 16 bytes of 4-bit scale | 4-bit min, 64 bytes of 2-bit quants, f16 d, f16 dmin.
- Q3_K (110): 32 bytes of high-bit masks, 64 bytes of 2-bit quants, 12 bytes of 6-bit scales (offset 32), f16 d;
  value = (d * (sc - 32)) * (q - 4 * (1 - hbit)).

The 6-bit scales of Q4_K/Q5_K (12 bytes s[0..11]): sub-block j < 4 has scale s[j] & 63 and min s[j+4] & 63;
j >= 4 has scale (s[j+4] & 15) | (s[j-4] >> 6) << 4 and min (s[j+4] >> 4) | (s[j] >> 6) << 4. With
i = j % 4 and P, Q, R = s[i], s[i+4], s[i+8], both cases read the same three bytes: scale P & 63 or
(R & 15) | (P >> 6) << 4, min Q & 63 or (R >> 4) | (Q >> 6) << 4. A tile decodes its sub-blocks' scales
once, as [rows, sub-blocks], and broadcasts them over the sub-blocks' values ([rows, sub-blocks, values]).

Two launchers per type, both ``launcher(x, qweight, out_features, in_features, out)``: x [T, K] in bf16, fp16 or
fp32 (its last dimension contiguous, any row stride), ``out`` [T, N] in x's dtype (likewise), written in place;
no allocation and no host sync, so both can be captured in a CUDA graph. Importing the module registers both
for each type with ``cvllm_gguf.kernels.register``.

- GEMV (decode, small T): a program owns BLOCK_N weight rows and walks their super-blocks once, one per
  step, multiplying the decoded [BLOCK_N, 256] tile (fp32) with all T rows of x (T padded to a power of two
  inside the program), fp32 accumulation. Grid: cdiv(N, BLOCK_N).
- GEMM (prefill, larger T): [BLOCK_M, BLOCK_N] output tiles, K in steps of BLOCK_K (a part of a super-block,
  whole sub-blocks): the weight tile is decoded to fp32, rounded to x's dtype and fed to ``tl.dot`` with an
  fp32 accumulator (fp32 x: an fp32 dot, input_precision "ieee"). Grid: (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)).

Each value's quant bits are gathered from its own byte address, so the bytes that pack two or four values are
loaded that many times (the repeats hit L1). Tile sizes are defaults, not tuned on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from cvllm_gguf.kernels import register
from cvllm_gguf.quant_types import FORMATS, QK_K, GGMLType

# the GGML type ids, as the kernels' constexpr switch sees them
_Q2_K: tl.constexpr = tl.constexpr(int(GGMLType.Q2_K))
_Q3_K: tl.constexpr = tl.constexpr(int(GGMLType.Q3_K))
_Q4_K: tl.constexpr = tl.constexpr(int(GGMLType.Q4_K))
_Q5_K: tl.constexpr = tl.constexpr(int(GGMLType.Q5_K))
_Q6_K: tl.constexpr = tl.constexpr(int(GGMLType.Q6_K))

K_TYPES = (GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q2_K, GGMLType.Q3_K)
SUB_BLOCK = {GGMLType.Q4_K: 32, GGMLType.Q5_K: 32, GGMLType.Q6_K: 16, GGMLType.Q2_K: 16, GGMLType.Q3_K: 16}


@triton.jit
def _f16(p, ok):
    """The little-endian f16 at byte pointers ``p`` (any shape) as fp32; 0 where ``ok`` is false. Two byte
    loads, so a block need not sit on a 2-byte boundary."""
    lo = tl.load(p, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(p, ok):
    return tl.load(p, mask=ok, other=0).to(tl.int32)


@triton.jit
def _k4_scales(b, ok, j):
    """Q4_K/Q5_K: the 6-bit (scale, min) of sub-blocks ``j`` [1, S] of blocks ``b`` [R, 1] from the 12 bytes at 4."""
    i = j % 4
    p = _byte(b + 4 + i, ok)
    q = _byte(b + 8 + i, ok)
    r = _byte(b + 12 + i, ok)
    first = j < 4
    sc = tl.where(first, p & 63, (r & 15) | ((p >> 6) << 4))
    mn = tl.where(first, q & 63, (r >> 4) | ((q >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(b, ok, k0, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_K]: values k0 .. k0 + BLOCK_K - 1 (whole sub-blocks) of the super-blocks at byte
    pointers ``b`` [BLOCK_N, 1]; rows where ``ok`` [BLOCK_N, 1] is false read as 0."""
    if QTYPE == _Q4_K or QTYPE == _Q5_K:
        NSUB: tl.constexpr = BLOCK_K // 32
        j = k0 // 32 + tl.arange(0, NSUB)[None, :]                  # [1, NSUB] sub-blocks
        d = _f16(b, ok)                                             # [BLOCK_N, 1]
        dmin = _f16(b + 2, ok)
        sc, mn = _k4_scales(b, ok, j)                               # [BLOCK_N, NSUB]
        dl = (d * sc)[:, :, None]
        ml = (dmin * mn)[:, :, None]
        j3 = j[:, :, None]                                          # [1, NSUB, 1]
        lane = tl.arange(0, 32)[None, None, :]                      # [1, 1, 32]
        b3 = b[:, :, None]
        ok3 = ok[:, :, None]
        if QTYPE == _Q4_K:
            q = (_byte(b3 + 16 + 32 * (j3 // 2) + lane, ok3) >> (4 * (j3 % 2))) & 15
        else:
            low = (_byte(b3 + 48 + 32 * (j3 // 2) + lane, ok3) >> (4 * (j3 % 2))) & 15
            high = (_byte(b3 + 16 + lane, ok3) >> j3) & 1
            q = low | (high << 4)
        w = dl * q.to(tl.float32) - ml
    else:
        NSUB: tl.constexpr = BLOCK_K // 16
        j = k0 // 16 + tl.arange(0, NSUB)[None, :]                  # [1, NSUB] sub-blocks of 16
        j3 = j[:, :, None]
        lane = tl.arange(0, 16)[None, None, :]
        b3 = b[:, :, None]
        ok3 = ok[:, :, None]
        # values 128g .. 128g + 127 (g = j // 8) come from 32 bytes of 2-bit fields (Q2_K, Q3_K, Q6_K's high
        # parts): value 16 * (j % 8) + lane of the half sits in byte 16 * (j % 2) + lane, bits 2 * ((j % 8) // 2)
        two_bit = 32 * (j3 // 8) + 16 * (j3 % 2) + lane
        two_shift = 2 * ((j3 % 8) // 2)
        if QTYPE == _Q6_K:
            d = _f16(b + 208, ok)
            sc = tl.load(b + 192 + j, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            low = (_byte(b3 + 64 * (j3 // 8) + 16 * (j3 % 4) + lane, ok3) >> (4 * ((j3 % 8) // 4))) & 15
            high = (_byte(b3 + 128 + two_bit, ok3) >> two_shift) & 3
            w = (d * sc)[:, :, None] * ((low | (high << 4)) - 32).to(tl.float32)
        elif QTYPE == _Q2_K:
            d = _f16(b + 80, ok)
            dmin = _f16(b + 82, ok)
            s = _byte(b + j, ok)
            dl = (d * (s & 15).to(tl.float32))[:, :, None]
            ml = (dmin * (s >> 4).to(tl.float32))[:, :, None]
            q = (_byte(b3 + 16 + two_bit, ok3) >> two_shift) & 3
            w = dl * q.to(tl.float32) - ml
        else:  # Q3_K
            d = _f16(b + 108, ok)
            low = (_byte(b + 96 + j % 8, ok) >> (4 * (j // 8))) & 15
            high = (_byte(b + 104 + j % 4, ok) >> (2 * (j // 4))) & 3
            dl = (d * ((low | (high << 4)) - 32).to(tl.float32))[:, :, None]
            ql = (_byte(b3 + 32 + two_bit, ok3) >> two_shift) & 3
            hbit = (_byte(b3 + 16 * (j3 % 2) + lane, ok3) >> (j3 // 2)) & 1
            w = dl * (ql - 4 + 4 * hbit).to(tl.float32)
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit(do_not_specialize=["T"])
def _gemv_kernel(x_ptr, w_ptr, out_ptr, T, N, num_blocks, stride_xm, stride_wn, stride_om,
                 QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    blocks = w_ptr + rows.to(tl.int64)[:, None] * stride_wn        # [BLOCK_N, 1]: the rows' first super-block
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    k = tl.arange(0, 256)
    x_ptrs = x_ptr + t.to(tl.int64)[:, None] * stride_xm + k[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for _ in range(num_blocks):
        w = _decode(blocks, row_ok[:, None], 0, QTYPE, BLOCK_N, 256)  # [BLOCK_N, 256]
        x = tl.load(x_ptrs, mask=t_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        blocks += TYPE_SIZE
        x_ptrs += 256
    out_ptrs = out_ptr + t.to(tl.int64)[:, None] * stride_om + rows[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & row_ok[None, :])


@triton.jit(do_not_specialize=["T"])
def _gemm_kernel(x_ptr, w_ptr, out_ptr, T, N, num_blocks, stride_xm, stride_wn, stride_om,
                 QTYPE: tl.constexpr, TYPE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < T
    n_ok = (n < N)[:, None]
    blocks = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + m.to(tl.int64)[:, None] * stride_xm + k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(num_blocks):
        for part in tl.static_range(256 // BLOCK_K):
            w = _decode(blocks, n_ok, part * BLOCK_K, QTYPE, BLOCK_N, BLOCK_K)   # [BLOCK_N, BLOCK_K] fp32
            x = tl.load(x_ptrs + part * BLOCK_K, mask=m_ok[:, None], other=0.0)
            if FP32_DOT:  # the weight still rounded to x's dtype, as on the tensor-core path
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        blocks += TYPE_SIZE
        x_ptrs += 256
    out_ptrs = out_ptr + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & (n < N)[None, :])


def _check(qtype: GGMLType, x: torch.Tensor, qweight: torch.Tensor, out_features: int, in_features: int,
           out: torch.Tensor) -> None:
    """Shapes, dtypes and strides only (host metadata: no sync)."""
    fmt = FORMATS[qtype]
    if in_features % QK_K:
        raise ValueError(f"{qtype.name} rows of {in_features} values do not split into super-blocks of {QK_K}")
    row_bytes = in_features // QK_K * fmt.type_size
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or tuple(qweight.shape) != (out_features, row_bytes) \
            or qweight.stride(1) != 1:
        raise ValueError(f"{qtype.name} qweight must be uint8 [{out_features}, {row_bytes}] with contiguous rows, "
                         f"got {qweight.dtype} {list(qweight.shape)} strides {qweight.stride()}")
    if x.dim() != 2 or x.shape[1] != in_features or x.stride(1) != 1 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be [T, {in_features}] bf16/fp16/fp32 with contiguous rows, got {x.dtype} "
                         f"{list(x.shape)} strides {x.stride()}")
    if tuple(out.shape) != (x.shape[0], out_features) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{x.shape[0]}, {out_features}] {x.dtype} with contiguous rows, got "
                         f"{out.dtype} {list(out.shape)}")


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# triton 3.6's interpreter multiplies bf16 dot operands as their raw uint16 bits: there the GEMM's bf16 dot
# runs in fp32 on the same bf16-rounded values
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

GEMV_BLOCK_N = 4
GEMV_WARPS = 4


def gemv(qtype: GGMLType, x: torch.Tensor, qweight: torch.Tensor, out_features: int, in_features: int,
         out: torch.Tensor, block_n: int = GEMV_BLOCK_N) -> torch.Tensor:
    """``out = x @ W.T`` for a few rows of x (decode): every program reads its rows' blocks once for all T rows."""
    _check(qtype, x, qweight, out_features, in_features, out)
    t = x.shape[0]
    if t == 0 or out_features == 0:
        return out
    _gemv_kernel[(triton.cdiv(out_features, block_n),)](
        x, qweight, out, t, out_features, in_features // QK_K, x.stride(0), qweight.stride(0), out.stride(0),
        QTYPE=int(qtype), TYPE_SIZE=FORMATS[qtype].type_size, BLOCK_T=triton.next_power_of_2(t),
        BLOCK_N=block_n, num_warps=GEMV_WARPS)
    return out


def gemm_tile(t: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for T rows of x: untuned defaults."""
    block_m = min(64, max(16, triton.next_power_of_2(t)))
    return block_m, 64, 64, 4


def gemm(qtype: GGMLType, x: torch.Tensor, qweight: torch.Tensor, out_features: int, in_features: int,
         out: torch.Tensor, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``out = x @ W.T`` with the weight tile dequantized in registers for ``tl.dot`` (prefill)."""
    _check(qtype, x, qweight, out_features, in_features, out)
    t = x.shape[0]
    if t == 0 or out_features == 0:
        return out
    block_m, block_n, block_k, warps = tile or gemm_tile(t)
    assert QK_K % block_k == 0 and block_k % SUB_BLOCK[qtype] == 0, (qtype, block_k)
    grid = (triton.cdiv(t, block_m), triton.cdiv(out_features, block_n))
    _gemm_kernel[grid](
        x, qweight, out, t, out_features, in_features // QK_K, x.stride(0), qweight.stride(0), out.stride(0),
        QTYPE=int(qtype), TYPE_SIZE=FORMATS[qtype].type_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_DOT=x.dtype == torch.float32 or (_INTERPRET and x.dtype == torch.bfloat16), num_warps=warps)
    return out


Launcher = Callable[[torch.Tensor, torch.Tensor, int, int, torch.Tensor], torch.Tensor]


def _launchers(qtype: GGMLType) -> tuple[Launcher, Launcher]:
    def gemv_launcher(x, qweight, out_features, in_features, out):
        return gemv(qtype, x, qweight, out_features, in_features, out)

    def gemm_launcher(x, qweight, out_features, in_features, out):
        return gemm(qtype, x, qweight, out_features, in_features, out)

    name = qtype.name.lower()
    gemv_launcher.__name__ = gemv_launcher.__qualname__ = f"{name}_gemv"
    gemm_launcher.__name__ = gemm_launcher.__qualname__ = f"{name}_gemm"
    return gemv_launcher, gemm_launcher


# {qtype: (gemv launcher, gemm launcher)}
LAUNCHERS: dict[GGMLType, tuple[Launcher, Launcher]] = {qtype: _launchers(qtype) for qtype in K_TYPES}
q4_k_gemv, q4_k_gemm = LAUNCHERS[GGMLType.Q4_K]
q5_k_gemv, q5_k_gemm = LAUNCHERS[GGMLType.Q5_K]
q6_k_gemv, q6_k_gemm = LAUNCHERS[GGMLType.Q6_K]
q2_k_gemv, q2_k_gemm = LAUNCHERS[GGMLType.Q2_K]
q3_k_gemv, q3_k_gemm = LAUNCHERS[GGMLType.Q3_K]

for _qtype, (_gemv, _gemm) in LAUNCHERS.items():
    register(_qtype, _gemv, _gemm)
