"""Small fused CPU kernels for the decode step's elementwise work: plain C compiled once with the system's C compiler
(about a second), cached on disk, and called through ctypes.

Why: at batch 1 a 30-layer decode step of a 135M model is mostly op overhead. torch's ``rms_norm`` on bf16 runs as a
dozen nested aten ops (~25 µs for 576 values), so a layer's two residual adds + norms and its SiLU gate cost ~80 µs
of dispatch for a few µs of arithmetic; one C call (~3-5 µs with ctypes) does an add + norm, and another the neox
rotary of q and k (~8 ops in torch). (A SiLU gate in C was slower than torch's: expf does not vectorise without
-ffast-math.) ``torch.compile`` was
measured for this and does not pay here: a compiled add + norm took longer a call than eager (66 vs 46 µs, its guards
and wrapper) after a minute of compiling on 2 cores.

The kernels compute in float32 and round to bf16 where the torch code they replace rounds (RMSNorm.forward:
``x + residual`` rounded, the norm rounded, times the weight rounded; RotaryEmbedding._rotate: each product rounded,
then their sum), with round-to-nearest-even as torch's conversion, so their results are bit-equal to it. For the
norm that takes torch's own order of the sum of squares: on CPU ``F.rms_norm`` is composite (float32 copy, pow,
mean as a cascade sum then a division, + eps, rsqrt, mul, round), and ``torch_row_sum`` below adds in the order of
its sum kernel (another order moved about one norm in 300 by a bf16 step, enough to flip a near-tie greedy token).
cpu_fused.py checks that equality against torch once per process before it offers the kernel.

The code is built for the vector width torch itself dispatches to (``torch.backends.cpu.get_cpu_capability()``:
AVX-512, AVX2 or neither), so ``ATEN_CPU_CAPABILITY=avx2`` gives the AVX2 build on an AVX-512 machine too. Without a
C compiler (or ``CVLLM_CPU_KERNELS=0``) ``load()`` returns None and the layers run their torch code.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "CVLLM_CPU_KERNELS"
MAX_ROWS = 64   # larger inputs (prefill) keep torch's multi-threaded code: this C is one thread

SOURCE = r"""
#include <stdint.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t v) { union { uint32_t u; float f; } c; c.u = (uint32_t)v << 16; return c.f; }
static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even; NaN -> 0x7fc0, as torch (branch-free) */
    union { uint32_t u; float f; } c; c.f = f;
    uint16_t rounded = (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
    return (c.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : rounded;
}

/* 8 float lanes under every capability, AVX-512 included: measured, 8 lanes reproduce torch's sums on every row of
   every size tried, where 16 (AVX-512's register width) miss on some rows */
#define VEC 8
#define ILP 4
#define LEVELS 4
static int64_t ceil_log2(int64_t x) {   /* c10::utils::CeilLog2 */
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) bits++;
    return bits;
}

/* torch's float sum of one contiguous row, in its order (ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum ->
   row_sum -> multi_row_sum, Vectorized<float> of VEC lanes): ILP accumulators of vectors each with a cascade of
   LEVELS, the vectors past the ILP blocks into the first, the accumulators summed, the tail elements summed from 0,
   then the lanes added to that in order. rms_norm is composite on CPU (pow, mean = sum then div, add eps, rsqrt),
   so its norm is bit-equal only if the sum of squares is added in exactly this order. n >= VEC. */
static float torch_row_sum(const float *in, int64_t n) {
    const int64_t vec_size = n / VEC, size = vec_size / ILP;
    int64_t level_power = ceil_log2(size) / LEVELS;
    if (level_power < 4) level_power = 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][VEC] = {{{0}}};
    int64_t i = 0;
    while (i + level_step <= size) {
        for (int64_t j = 0; j < level_step; ++j, ++i)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < VEC; l++) acc[0][k][l] += in[(i * ILP + k) * VEC + l];
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < VEC; l++) { acc[j][k][l] += acc[j - 1][k][l]; acc[j - 1][k][l] = 0.0f; }
            if ((i & (level_mask << (j * level_power))) != 0) break;
        }
    }
    for (; i < size; ++i)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < VEC; l++) acc[0][k][l] += in[(i * ILP + k) * VEC + l];
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < VEC; l++) acc[0][k][l] += acc[j][k][l];
    for (i = size * ILP; i < vec_size; ++i)
        for (int l = 0; l < VEC; l++) acc[0][0][l] += in[i * VEC + l];
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < VEC; l++) acc[0][0][l] += acc[0][k][l];
    float sum = 0.0f;
    for (int64_t t = vec_size * VEC; t < n; t++) sum += in[t];
    for (int l = 0; l < VEC; l++) sum += acc[0][0][l];
    return sum;
}

/* out = bf16(bf16(norm(h)) * w), h = bf16(x + residual) (or x) written to res_out when residual is given */
void add_rms_norm_bf16(const uint16_t *x, const uint16_t *residual, const uint16_t *w, uint16_t *out,
                       uint16_t *res_out, int64_t rows, int64_t cols, float eps) {
    float h[cols], sq[cols];
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * cols;
        if (residual) {
            const uint16_t *rr = residual + r * cols;
            uint16_t *hr = res_out + r * cols;
            for (int64_t i = 0; i < cols; i++) {
                uint16_t b = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(rr[i]));
                hr[i] = b;
                h[i] = bf16_to_f32(b);
            }
        } else {
            for (int64_t i = 0; i < cols; i++) h[i] = bf16_to_f32(xr[i]);
        }
        for (int64_t i = 0; i < cols; i++) sq[i] = h[i] * h[i];   /* pow(x, 2): rounded before the sum */
        float scale = 1.0f / sqrtf(torch_row_sum(sq, cols) / (float)cols + eps);   /* mean, + eps, rsqrt */
        uint16_t *o = out + r * cols;
        for (int64_t i = 0; i < cols; i++)
            o[i] = f32_to_bf16(bf16_to_f32(f32_to_bf16(h[i] * scale)) * bf16_to_f32(w[i]));
    }
}

static inline uint16_t mul_bf16(uint16_t a, uint16_t b) { return f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b)); }

/* neox rotary of `heads` heads of `dim` per row, as RotaryEmbedding._rotate rounds it:
   out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), cos/sin the row `pos` of table [*, dim] (cos | sin) */
static void rotate_rows(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t rows, int64_t heads,
                        int64_t dim, const int64_t *pos, const uint16_t *table) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = table + pos[r] * dim, *s = c + half;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * x_stride + h * dim;
            uint16_t *oh = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < half; i++) {
                float lo = bf16_to_f32(mul_bf16(xh[i], c[i])) - bf16_to_f32(mul_bf16(xh[i + half], s[i]));
                float hi = bf16_to_f32(mul_bf16(xh[i + half], c[i])) + bf16_to_f32(mul_bf16(xh[i], s[i]));
                oh[i] = f32_to_bf16(lo);
                oh[i + half] = f32_to_bf16(hi);
            }
        }
    }
}

void rotary_bf16(const uint16_t *q, const uint16_t *k, int64_t row_stride, uint16_t *q_out, uint16_t *k_out,
                 int64_t rows, int64_t q_heads, int64_t k_heads, int64_t dim, const int64_t *pos,
                 const uint16_t *table) {
    rotate_rows(q, row_stride, q_out, rows, q_heads, dim, pos, table);
    if (k) rotate_rows(k, row_stride, k_out, rows, k_heads, dim, pos, table);
}
"""

FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
         "AVX2": ["-mavx2", "-mfma", "-mf16c"]}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "cvllm" / "cpu_kernels"


def _compile(target: Path, source: str, flags: list[str]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, lib = Path(tmp) / "kernels.c", Path(tmp) / target.name
        src.write_text(source)
        # -fno-math-errno: sqrtf without errno (vectorisable); no -ffast-math: NaN and rounding stay IEEE
        subprocess.run([compiler, "-O3", "-fPIC", "-shared", "-fno-math-errno", *flags, str(src),
                        "-o", str(lib), "-lm"], check=True, capture_output=True, timeout=120)
        os.replace(lib, target)   # atomic: another process loading the same file sees it whole or not at all


def build(name: str, source: str, flags: list[str]) -> ctypes.PyDLL | None:
    """``source`` compiled for the vector width torch dispatches to (plus ``flags``), from the disk cache after the
    first time; None without a compiler or with ``CVLLM_CPU_KERNELS=0`` (the callers then run torch code)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    flags = FLAGS.get(capability, []) + flags
    key = hashlib.sha256((source + " ".join(flags)).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{capability.lower()}-{key}.so"
    try:
        if not target.exists():
            _compile(target, source, flags)
            logger.info("CPU kernels %s compiled for %s into %s", name, capability, target)
        # PyDLL: calls keep the GIL. They take microseconds, and releasing it let another Python thread (the
        # engine's, the server's) take a core mid-step, where an OpenMP kernel's second thread then waits for it
        return ctypes.PyDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels %s unavailable (%s): torch code runs instead", name, e)
        return None


@functools.cache
def load() -> ctypes.PyDLL | None:
    """The compiled kernels (built on first use, then from the disk cache), or None where they cannot be had."""
    # -ffp-contract=off: no fused multiply-adds, each product rounded as torch's separate ops round it
    lib = build("kernels", SOURCE, ["-ffp-contract=off"])
    if lib is None:
        return None
    lib.add_rms_norm_bf16.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    lib.add_rms_norm_bf16.restype = None
    lib.rotary_bf16.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p]
    lib.rotary_bf16.restype = None
    return lib
