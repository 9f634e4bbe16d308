"""A few-row matmul over torch's int4-packed CPU weights (the layout of ``aten._convert_weight_to_int4pack_for_cpu``,
read by ``aten._weight_int4pack_mm_for_cpu``), in C through cpu_kernels.build: float32 activations and sums, the
scales applied per group of 32 in float32 after the group's integer-weighted sum. The GGUF LM head's int4 planes use
it (plugins/quant-gguf int4planes.py), whose scales are float32 so that the logits are exact but for float32 sums.

Why not torch's op there: it rounds the scales to bf16 per group and its output to bf16, which put the demo model's
logits further from the exact ones than a bf16 copy of its table (and flipped a near-tie greedy token). Per group g
and row n this computes ``s * sum_k x_k p_k + (z - 8 s) * sum_k x_k`` (p the 4-bit integers, the op's
``(p - 8) s + z``), the weights widened nibble by nibble to float, at about the op's speed (1 row) and faster at
4-16 rows (it reads the weights once for up to 4 rows on AVX-512, 2 on AVX2, per pass).

Not used for the linears: measured end to end on the demo model (batch 1, 2 threads) it decoded slower than torch's
op on both CPU kinds, though a single call was as fast (AVX-512) or faster (AVX2) at 1 thread. llama.cpp's q8 dot
path (activations quantized to int8 per 32, VNNI / maddubs dot products) would need 4 consecutive k of a row in
each 32-bit lane, where this layout holds 32 or 64 rows of one k side by side: a transposing shuffle per 4 k, or a
layout of its own beside torch's (measured and weighed for issue 24, 2026-12-03).

Layout: rows in tiles of T (64 on AVX-512, 32 on AVX2: int4planes.row_tile finds it), each tile [K, T / 2] bytes,
byte j of a k holding row j in its low nibble and row j + T / 2 in its high one. Rows split over torch's OpenMP
threads (the .so links libgomp by soname, so it shares torch's pool: no second set of spinning threads).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from cvllm.backends import cpu_kernels

GROUP = 32
MAX_ROWS = 16   # activation rows a call takes (the sampled rows of a decode step); callers split more

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX2__)   /* only the AVX2 and AVX-512 builds have the kernel: elsewhere torch's op runs */
int64_t int4pack_tile(void) { return 0; }
void int4pack_mm(void) {}
#else
#include <immintrin.h>

/* VW floats a vector register (8 on AVX2, 16 on AVX-512); MC activation rows a pass, as many as keep the sums in
   registers (4 x 4 of 32 zmm; 2 x 4 of 16 ymm). A tile (64 rows on AVX-512, 32 on AVX2) is R = 4 vectors of rows. */
#ifdef __AVX512F__
#define VW 16
#define MAXMC 4
#else
#define VW 8
#define MAXMC 2
#endif
#define R 4
#define T (R * VW)
#define GS 32
typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
#define INL static inline __attribute__((always_inline))

/* the R vectors of one k's row weights from its T / 2 bytes, in intrinsics (gcc's vector extensions scalarise the
   byte-to-float widening: pextrb + cvtsi2ss a lane) */
INL void weights(const uint8_t *p, vf w[R]) {
#ifdef __AVX512F__
    const __m256i h = _mm256_loadu_si256((const __m256i *)p), mask = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(h, mask), hi = _mm256_and_si256(_mm256_srli_epi16(h, 4), mask);
    w[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)));
    w[1] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)));
    w[2] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)));
    w[3] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)));
#else
    const __m128i h = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(h, mask), hi = _mm_and_si128(_mm_srli_epi16(h, 4), mask);
    w[0] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    w[1] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    w[3] = (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
#endif
}

/* scale s and z - 8 s of VW rows at [g, n] of the [G, N, 2] pairs (float32, or bf16: its bits shifted up) */
INL void scale_zero(const void *sz, int fp32, int64_t at, vf *s, vf *z) {
    if (fp32) {
        vf a, b;
        memcpy(&a, (const float *)sz + 2 * at, VW * 4); memcpy(&b, (const float *)sz + 2 * at + VW, VW * 4);
#if VW == 16
        *s = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        *z = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
        *s = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
        *z = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
#endif
    } else {
        vu w; memcpy(&w, (const uint16_t *)sz + 2 * at, VW * 4);
        vu lo = w << 16, hi = w & 0xffff0000u;
        memcpy(s, &lo, VW * 4); memcpy(z, &hi, VW * 4);
    }
    *z = *z - 8.0f * *s;
}

/* out [MC][T] of one tile (rows n0 ..) for MC activation rows (a constant after inlining) */
INL void tile_rows(const uint8_t *tile, const int MC, const float *xf, const float *xs, int64_t K,
                   const void *sz, int fp32, int64_t N, int64_t n0, float out[MAXMC][T]) {
    const int64_t G = K / GS;
    memset(out, 0, sizeof(float) * MAXMC * T);
    for (int64_t g = 0; g < G; g++) {
        vf acc[MAXMC][R];
        for (int m = 0; m < MC; m++) for (int r = 0; r < R; r++) acc[m][r] = (vf){0};
        for (int64_t k = g * GS; k < g * GS + GS; k++) {
            vf w[R];
            weights(tile + k * (T / 2), w);   /* byte j: row j (low nibble), row j + T / 2 (high) */
            for (int m = 0; m < MC; m++) {
                const float xv = xf[m * K + k];
                for (int r = 0; r < R; r++) acc[m][r] += w[r] * xv;
            }
        }
        for (int r = 0; r < R; r++) {
            vf s, z, o;
            scale_zero(sz, fp32, g * N + n0 + VW * r, &s, &z);
            for (int m = 0; m < MC; m++) {
                memcpy(&o, out[m] + VW * r, VW * 4);
                o += s * acc[m][r] + z * xs[m * G + g];
                memcpy(out[m] + VW * r, &o, VW * 4);
            }
        }
    }
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even; NaN -> 0x7fc0, as torch */
    union { uint32_t u; float f; } c; c.f = f;
    uint16_t rounded = (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
    return (c.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded;
}

int64_t int4pack_tile(void) { return T; }

#define ROWS(MM) tile_rows(tile, MM, xf + m0 * K, xs + m0 * G, K, sz, (int)sz_fp32, N, t * T, o)

/* out [M, N] (float32 or bf16) = x [M, K] (bf16) @ w.T, w in tiles of T rows with scales/zeros [G, N, 2] */
void int4pack_mm(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, int64_t N,
                 const void *sz, int64_t sz_fp32, void *out, int64_t out_fp32) {
    const int64_t G = K / GS;
    float *xf = malloc(sizeof(float) * (M * K + M * G)), *xs = xf + M * K;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float sum = 0.0f;
            for (int64_t k = g * GS; k < g * GS + GS; k++) {
                union { uint32_t u; float f; } c; c.u = (uint32_t)x[m * K + k] << 16;
                xf[m * K + k] = c.f;
                sum += c.f;
            }
            xs[m * G + g] = sum;
        }
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / T; t++) {
        const uint8_t *tile = packed + t * K * (T / 2);
        for (int64_t m0 = 0; m0 < M; m0 += MAXMC) {
            const int64_t mc = M - m0 < MAXMC ? M - m0 : MAXMC;
            float o[MAXMC][T];
#if MAXMC == 4
            if (mc == 1) ROWS(1); else if (mc == 2) ROWS(2); else if (mc == 3) ROWS(3); else ROWS(4);
#else
            if (mc == 1) ROWS(1); else ROWS(2);
#endif
            for (int64_t m = 0; m < mc; m++) {
                const int64_t at = (m0 + m) * N + t * T;
                if (out_fp32) memcpy((float *)out + at, o[m], sizeof(float) * T);
                else for (int l = 0; l < T; l++) ((uint16_t *)out)[at + l] = f32_to_bf16(o[m][l]);
            }
        }
    }
    free(xf);
}
#endif
"""


@functools.cache
def load() -> ctypes.PyDLL | None:
    # -fopenmp: the rows over torch's threads; fused multiply-adds allowed (nothing here must match torch's bits)
    lib = cpu_kernels.build("int4mm", SOURCE, ["-fopenmp", "-ffp-contract=fast"])
    if lib is not None:
        lib.int4pack_mm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
        lib.int4pack_mm.restype = None
        lib.int4pack_tile.restype = ctypes.c_int64
    return lib


def int4pack_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, tile: int | None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """x [M, K] bf16 @ w.T as [M, N] ``out_dtype`` (bf16 or float32), w the int4-packed ``packed`` [N, K / 2] with
    ``scales_zeros`` [K / 32, N, 2] (bf16 or float32) and rows in tiles of ``tile``; None where this does not apply
    (more than MAX_ROWS rows, another dtype or layout, no compiler): the caller runs torch's op."""
    lib = load()
    if lib is None or tile != lib.int4pack_tile() or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS \
            or x.dtype != torch.bfloat16 or not x.is_contiguous() or out_dtype not in (torch.bfloat16, torch.float32):
        return None
    k = x.shape[1]
    n = packed.shape[0]
    if k % GROUP or n % tile or packed.dtype != torch.uint8 or packed.shape[1] * 2 != k or not packed.is_contiguous() \
            or scales_zeros.shape != (k // GROUP, n, 2) or not scales_zeros.is_contiguous() \
            or scales_zeros.dtype not in (torch.bfloat16, torch.float32):
        return None
    out = torch.empty(x.shape[0], n, dtype=out_dtype)
    lib.int4pack_mm(x.data_ptr(), x.shape[0], k, packed.data_ptr(), n, scales_zeros.data_ptr(),
                    int(scales_zeros.dtype == torch.float32), out.data_ptr(), int(out_dtype == torch.float32))
    return out
