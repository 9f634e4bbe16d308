"""One K step of one expert's planes for the MoE expert GEMVs (moe_planes_gemv.py): quant_gemv.py's inner loop on
tiles of any rank, the part's layout and input order a PartSpec constexpr.

Explicit ``tl.fma`` in the loop: the GEMV kernels compile without FMA contraction, so that their silu and product
epilogues round as torch's separate operations do (activation.py, moe_gemv.py), and the loop keeps its fused
multiply-adds all the same.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm_cuda.kernels.quant_gemv import _unit
from cvllm_cuda.kernels.quant_tiles import load_masked, word_factors


@triton.jit
def expert_planes(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, expert, N, K, P: tl.constexpr):
    """The six plane pointers moved to ``expert``'s planes (a scalar or a tensor of experts): stacked contiguous,
    expert e starts e * rows * N elements in. Absent planes point anywhere: they are never loaded."""
    e = expert.to(tl.int64) * N
    supers = K // P.layout.super_group
    scales = K // P.layout.scale_group
    return (low_ptr + e * (K * P.layout.low_bits // 32), high_ptr + e * (K * P.layout.high_bits // 32),
            d_ptr + e * supers, m_ptr + e * supers, a_ptr + e * scales, b_ptr + e * scales)


@triton.jit
def _input(x_ptr, perm_ptr, inputs, ok, HAS_PERM: tl.constexpr):
    """x at the planes' input indices ``inputs`` (through the part's input order with HAS_PERM), float32."""
    if HAS_PERM:
        inputs = load_masked(perm_ptr + inputs, ok, 0)
    return load_masked(x_ptr + inputs, ok, 0.0).to(tl.float32)


@triton.jit
def part_step(low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, x_ptr, perm_ptr, words, gwords, cols, word_ok, ok,
              group_ok, N, one_bits, P: tl.constexpr, GROUP_AXIS: tl.constexpr, INTERPRET: tl.constexpr):
    """The products of plane words ``words`` ([..., GROUPS, GW, 1]; ``gwords`` each group's first, [..., GROUPS, 1,
    1]) of output features ``cols`` ([..., 1, 1, BLOCK_N]) with their inputs of x: float32 [..., GROUPS, 1 or GW,
    BLOCK_N] (1 when P.group_sum: a group's words summed first, over axis GROUP_AXIS). Masks: ``word_ok`` the x
    loads, ``ok`` the words, ``group_ok`` the factors (None: in bounds)."""
    PER_WORD: tl.constexpr = 32 // P.layout.low_bits
    LOW_BITS: tl.constexpr = P.layout.low_bits
    HIGH_BITS: tl.constexpr = P.layout.high_bits
    FLOAT8: tl.constexpr = P.layout.float8
    UNIT: tl.constexpr = 1.0 if FLOAT8 else float(1 << (LOW_BITS + HIGH_BITS))
    low = load_masked(low_ptr + words * N + cols, ok, 0)
    high_at = low
    if HIGH_BITS > 0:
        first = words * PER_WORD
        high = load_masked(high_ptr + first // (32 // HIGH_BITS) * N + cols, ok, 0)
        high_at = high >> (first % (32 // HIGH_BITS) * HIGH_BITS)
    scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, gwords * PER_WORD, cols, group_ok, N,
                                 P.layout.scale_group, P.layout.super_group, P.layout.a_mode, P.layout.b_mode,
                                 P.layout.b_const, P.layout.has_m)
    inputs = words * PER_WORD
    x = _input(x_ptr, perm_ptr, inputs, word_ok, P.has_perm)
    part = _unit(low, high_at, 0, LOW_BITS, HIGH_BITS, FLOAT8, INTERPRET, one_bits) * x
    x_sum = x
    for S in tl.static_range(1, PER_WORD):
        x = _input(x_ptr, perm_ptr, inputs + S, word_ok, P.has_perm)
        unit = _unit(low, high_at, S, LOW_BITS, HIGH_BITS, FLOAT8, INTERPRET, one_bits)
        part = tl.fma(unit, tl.broadcast_to(x, unit.shape), part)
        x_sum += x
    # part = sum(x) + sum(q x) / UNIT per word (FP8: sum(q x)); the word's weights sum to scale * sum(q x) +
    # offset * sum(x)
    if P.group_sum:
        part = tl.sum(part, axis=GROUP_AXIS, keep_dims=True)
        x_sum = tl.sum(x_sum, axis=GROUP_AXIS, keep_dims=True)
    scaled = scale * UNIT
    rest = (offset if FLOAT8 else offset - scaled) * x_sum
    return tl.fma(part, tl.broadcast_to(scaled, part.shape), tl.broadcast_to(rest, part.shape))

