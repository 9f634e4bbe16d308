"""Q4_K / Q5_K's scale search (kquants._qkx2_quants with its rms weights) as one Triton kernel, for in-situ
quantization on a GPU: the same float32 operations in the same order, so the same bytes.

The torch form runs ~2,700 elementwise passes over the whole tensor (21 candidate scales x running sums over a
group's 32 values, each sum in C loop order), which made ``--isq q4k`` load a Llama-3-8B shape in ~27 s on the H200
against ~5 s for the other types. Here each thread owns one group of 32 and walks its values in order, in registers
and L1, so the tensor is read once. The groups go in transposed ([32, M]: value i of every group together), so that
a warp's 32 threads read one line per load instead of 32 (group-major, the ~2,100 loads of a thread each touched 32
lines, and q4k's load took longer than the torch form's).

Exactness: every step is an IEEE float32 operation as in kquants.py (products rounded before sums: FMA contraction
is off for this launch, ``enable_fp_fusion=False``; divisions and square roots correctly rounded); the candidate
numerators are formed on the host by kquants' own float32 arithmetic. The best quants so far live in the output
buffer and are rewritten in place when a candidate wins (candidates are recomputed, not stored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUPS_PER_PROGRAM = 128   # one group of 32 values per thread (4 warps)
CHUNK_GROUPS = 1 << 25     # groups a launch: 32 of them transposed stay within int32 offsets


@triton.jit
def _nearest_int(v):
    """ggml's nearest_int: round half to even through the float32 addition of 1.5 * 2**23."""
    return ((v + 12582912.0).to(tl.int32, bitcast=True) & 0x007FFFFF) - 0x00400000


@triton.jit
def _fit_kernel(x_ptr, nums_ptr, scale_ptr, min_ptr, levels_ptr, M, NMAX: tl.constexpr, NSTEP: tl.constexpr,
                BLOCK: tl.constexpr):
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = g < M
    row = x_ptr + g      # value i of group g at i * M + g: a warp's loads and stores are coalesced
    out = levels_ptr + g
    sq = tl.zeros((BLOCK,), tl.float32)
    low = tl.full((BLOCK,), float("inf"), tl.float32)
    high = tl.full((BLOCK,), float("-inf"), tl.float32)
    for i in tl.range(0, 32):
        v = tl.load(row + i * M, mask=ok, other=0.0)
        sq = sq + v * v
        low = tl.minimum(low, v)
        high = tl.maximum(high, v)
    rms = tl.math.sqrt_rn(tl.math.div_rn(sq, tl.full((BLOCK,), 32.0, tl.float32)))
    sum_w = tl.zeros((BLOCK,), tl.float32)
    sum_x = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, 32):
        v = tl.load(row + i * M, mask=ok, other=0.0)
        w = rms + tl.abs(v)
        sum_w = sum_w + w
        sum_x = sum_x + w * v
    low = tl.where(low > 0, 0.0, low)
    flat = high == low
    one = tl.full((BLOCK,), 1.0, tl.float32)
    span = tl.where(flat, one, high - low)
    iscale = tl.math.div_rn(tl.full((BLOCK,), NMAX, tl.float32), span)
    scale = tl.math.div_rn(one, iscale)
    best = tl.zeros((BLOCK,), tl.float32)
    for i in tl.range(0, 32):
        v = tl.load(row + i * M, mask=ok, other=0.0)
        level = tl.minimum(tl.maximum(_nearest_int(iscale * (v - low)), 0), NMAX)
        tl.store(out + i * M, level.to(tl.int8), mask=ok)
        diff = (scale * level.to(tl.float32) + low) - v
        best = best + (rms + tl.abs(v)) * (diff * diff)
    for step in tl.range(0, NSTEP + 1):
        ratio = tl.math.div_rn(tl.load(nums_ptr + step) + tl.zeros((BLOCK,), tl.float32),
                               tl.where(flat, one, high - low))
        sum_l = tl.zeros((BLOCK,), tl.float32)
        sum_l2 = tl.zeros((BLOCK,), tl.float32)
        sum_xl = tl.zeros((BLOCK,), tl.float32)
        for i in tl.range(0, 32):
            v = tl.load(row + i * M, mask=ok, other=0.0)
            c = tl.minimum(tl.maximum(_nearest_int(ratio * (v - low)), 0), NMAX).to(tl.float32)
            weighted = (rms + tl.abs(v)) * c
            sum_l = sum_l + weighted
            sum_l2 = sum_l2 + weighted * c
            sum_xl = sum_xl + weighted * v
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = tl.math.div_rn(sum_w * sum_xl - sum_x * sum_l, det)
        this_min = tl.math.div_rn(sum_l2 * sum_x - sum_l * sum_xl, det)
        positive = this_min > 0
        this_min = tl.where(positive, 0.0, this_min)
        this_scale = tl.where(positive, tl.math.div_rn(sum_xl, sum_l2), this_scale)
        current = tl.zeros((BLOCK,), tl.float32)
        for i in tl.range(0, 32):
            v = tl.load(row + i * M, mask=ok, other=0.0)
            c = tl.minimum(tl.maximum(_nearest_int(ratio * (v - low)), 0), NMAX).to(tl.float32)
            diff = (this_scale * c + this_min) - v
            current = current + (rms + tl.abs(v)) * (diff * diff)
        better = (det > 0) & (current < best) & (flat == 0)
        for i in tl.range(0, 32):
            v = tl.load(row + i * M, mask=ok, other=0.0)
            c = tl.minimum(tl.maximum(_nearest_int(ratio * (v - low)), 0), NMAX)
            tl.store(out + i * M, c.to(tl.int8), mask=ok & better)
        best = tl.where(better, current, best)
        scale = tl.where(better, this_scale, scale)
        low = tl.where(better, this_min, low)
    scale = tl.where(flat, 0.0, scale)
    tl.store(scale_ptr + g, scale, mask=ok)
    tl.store(min_ptr + g, low * -1.0, mask=ok)   # C's -min (Triton's -x is 0 - x: +0 for 0)
    for i in tl.range(0, 32):
        tl.store(out + i * M, tl.zeros((BLOCK,), tl.int8), mask=ok & flat)


def fit_groups(groups: torch.Tensor, numerators: torch.Tensor, nmax: int) -> tuple[torch.Tensor, ...]:
    """groups float32 [M, 32] (contiguous, on a CUDA device or under Triton's interpreter), numerators float32
    [nstep + 1] -> (scale [M], min [M], levels int32 [M, 32]): kquants._qkx2_quants with the rms weights of
    Q4_K / Q5_K."""
    m = groups.shape[0]
    scale = torch.empty(m, dtype=torch.float32, device=groups.device)
    low = torch.empty(m, dtype=torch.float32, device=groups.device)
    levels = torch.empty((m, 32), dtype=torch.int32, device=groups.device)
    for start in range(0, m, CHUNK_GROUPS):   # the kernel's offsets i * M + g are int32
        end = min(m, start + CHUNK_GROUPS)
        n = end - start
        levels_t = torch.empty((32, n), dtype=torch.int8, device=groups.device)
        _fit_kernel[(triton.cdiv(n, GROUPS_PER_PROGRAM),)](
            groups[start:end].t().contiguous(), numerators, scale[start:], low[start:], levels_t, n, NMAX=nmax,
            NSTEP=numerators.numel() - 1, BLOCK=GROUPS_PER_PROGRAM, num_warps=4, enable_fp_fusion=False)
        levels[start:end] = levels_t.t()
    return scale, low, levels
