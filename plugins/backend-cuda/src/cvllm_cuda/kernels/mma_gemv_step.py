"""One K step of the tensor-core GEMV (quant_gemv_mma.py, whose docstring says how the lanes hold the fragments): a
unit's MMAs, the step's words and x, and its scale groups' factors applied in float32. Every tensor is [lanes] (or
[lanes, 4]: a lane's 16-byte loads), one row a lane."""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm_cuda.kernels.mma_fragments import ONES, mma, nibble_pairs, x_pairs
from cvllm_cuda.kernels.quant_tiles import load_masked, word_factors


@triton.jit
def unit_mma(words, xs, acc, BLOCKS: tl.constexpr, TG: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc`` plus one unit's MMAs (the module's docstring). ``words``: 2 BLOCKS int32 [W * 32], block b's words of
    the lane row's features 2 b and 2 b + 1 (A's rows g and g + 8); ``xs``: x's pairs (x_pairs) of each token group;
    ``acc``: block b's c0-c3 of token group t at 4 (b TG + t), then X of the group's tokens 2 j, 2 j + 1 at
    4 BLOCKS TG + 2 t."""
    out = ()
    for b in tl.static_range(BLOCKS):
        lo = words[2 * b]
        hi = words[2 * b + 1]
        first = (nibble_pairs(lo, 0, INTERPRET), nibble_pairs(hi, 0, INTERPRET), nibble_pairs(lo, 4, INTERPRET),
                 nibble_pairs(hi, 4, INTERPRET))
        second = (nibble_pairs(lo, 8, INTERPRET), nibble_pairs(hi, 8, INTERPRET), nibble_pairs(lo, 12, INTERPRET),
                  nibble_pairs(hi, 12, INTERPRET))
        for t in tl.static_range(TG):
            c = (acc[(b * TG + t) * 4], acc[(b * TG + t) * 4 + 1], acc[(b * TG + t) * 4 + 2],
                 acc[(b * TG + t) * 4 + 3])
            c = mma(first, (xs[4 * t], xs[4 * t + 1]), c, INTERPRET)
            out = out + mma(second, (xs[4 * t + 2], xs[4 * t + 3]), c, INTERPRET)
    ones = tl.full(xs[0].shape, ONES, tl.int32)
    for t in tl.static_range(TG):
        s = (acc[BLOCKS * TG * 4 + 2 * t], acc[BLOCKS * TG * 4 + 2 * t + 1], acc[BLOCKS * TG * 4 + 2 * t],
             acc[BLOCKS * TG * 4 + 2 * t + 1])
        s = mma((ones, ones, ones, ones), (xs[4 * t], xs[4 * t + 1]), s, INTERPRET)
        s = mma((ones, ones, ones, ones), (xs[4 * t + 2], xs[4 * t + 3]), s, INTERPRET)
        out = out + (s[0], s[1])
    return out


@triton.jit
def load_words(rows, first_feature, N, FW: tl.constexpr, EVEN_N: tl.constexpr, more=None):
    """A word row's FW words of the lane's features first_feature ... (16- or 8-byte loads; rows of a [W * 32, 4 or
    2] tensor stay one a lane), as FW tensors [W * 32]. ``more``: a scalar condition for every load (None: none)."""
    PART: tl.constexpr = 4 if FW >= 4 else FW
    cols = tl.arange(0, PART)[None, :]
    out = ()
    for part in tl.static_range(FW // PART):
        ptrs = rows[:, None] + part * PART + cols
        if EVEN_N:
            words = load_masked(ptrs, more, 0)
        else:
            ok = first_feature[:, None] + part * PART + cols < N
            if more is not None:
                ok = ok & more
            words = tl.load(ptrs, mask=ok, other=0)
        out = out + columns(words)
    return out


@triton.jit
def step_words(low_ptrs, first_feature, N, KU: tl.constexpr, FW: tl.constexpr, EVEN_N: tl.constexpr, more=None):
    """A K step's words: for each of its KU units, the lane's FW words (load_words)."""
    words = ()
    for u in tl.static_range(KU):
        words = words + (load_words(low_ptrs + u * 4 * N, first_feature, N, FW, EVEN_N, more),)
    return words


@triton.jit
def step_mma(words, low_ptrs, first_feature, N, x_ptrs, g, T, K, zero, KU: tl.constexpr, FW: tl.constexpr,
              TG: tl.constexpr, BLOCKS: tl.constexpr, EVEN_N: tl.constexpr, INTERPRET: tl.constexpr,
              LOADED: tl.constexpr):
    """A K step's sums (unit_mma's ``acc``) of its words times x's pairs at ``x_ptrs``: the words ``words``
    (step_words) where LOADED, else each unit's loaded at ``low_ptrs`` as it is needed (fewer registers live in the
    loop: 70 against 76 at 1-8 rows)."""
    acc = zeros(zero, BLOCKS * TG * 4 + TG * 2)
    for u in tl.static_range(KU):
        if LOADED:
            unit = words[u]
        else:
            unit = load_words(low_ptrs + u * 4 * N, first_feature, N, FW, EVEN_N)
        xs = ()
        for t in tl.static_range(TG):
            xw = columns(tl.load(x_ptrs + (8 * t * (K // 2) + u * 16), mask=(g + 8 * t < T)[:, None], other=0))
            xs = xs + x_pairs(xw[0], xw[1], xw[2], xw[3], INTERPRET)
        acc = unit_mma(unit, xs, acc, BLOCKS, TG, INTERPRET)
    return acc


@triton.jit
def feature_factors(w0, h, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP: tl.constexpr,
                     SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                     HAS_M: tl.constexpr, EVEN_N: tl.constexpr, more=None):
    """The K step at word ``w0``'s scale and ``offset - 128 scale`` of the lane's feature ``first_feature + h``
    (``more``: load_words')."""
    f = first_feature + h
    if EVEN_N:
        ok = more
    else:
        ok = f < N
        if more is not None:
            ok = ok & more
    scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, w0 * 8, f, ok, N, SCALE_GROUP, SUPER_GROUP, A_MODE,
                                 B_MODE, B_CONST, HAS_M)
    return scale, offset - 128.0 * scale


@triton.jit
def step_factors(w0, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP: tl.constexpr,
                  SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                  HAS_M: tl.constexpr, FW: tl.constexpr, EVEN_N: tl.constexpr, more=None):
    """feature_factors of each of the lane's FW features, in turn (a step's factors loaded ahead of its MMAs)."""
    out = ()
    for h in tl.static_range(FW):
        out = out + feature_factors(w0, h, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP, SUPER_GROUP,
                                     A_MODE, B_MODE, B_CONST, HAS_M, EVEN_N, more)
    return out


@triton.jit
def apply_factors(y, acc, factors, w0, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N, SCALE_GROUP: tl.constexpr,
                   SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                   HAS_M: tl.constexpr, EVEN_N: tl.constexpr, TG: tl.constexpr, BLOCKS: tl.constexpr,
                   LOADED: tl.constexpr):
    """``y`` plus a K step's sums ``acc`` under its factors: ``factors`` (step_factors) where LOADED, else each
    feature's loaded as it is needed (fewer registers live in the loop). Feature 2 b + half is A's row g (+ 8 for
    half 1) of block b, c0, c1 (c2, c3)."""
    new_y = ()
    for b in tl.static_range(BLOCKS):
        for half in tl.static_range(2):
            if LOADED:
                scale = factors[2 * (2 * b + half)]
                base = factors[2 * (2 * b + half) + 1]
            else:
                scale, base = feature_factors(w0, 2 * b + half, d_ptr, m_ptr, a_ptr, b_ptr, first_feature, N,
                                               SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, EVEN_N)
            for t in tl.static_range(TG):   # (indices stay expressions: a constexpr named in jit code is a tensor)
                new_y = new_y + (
                    y[((2 * b + half) * TG + t) * 2] + scale * acc[(b * TG + t) * 4 + 2 * half]
                    + base * acc[BLOCKS * TG * 4 + 2 * t],
                    y[((2 * b + half) * TG + t) * 2 + 1] + scale * acc[(b * TG + t) * 4 + 2 * half + 1]
                    + base * acc[BLOCKS * TG * 4 + 2 * t + 1])
    return new_y


@triton.jit
def columns(t):
    """The columns of ``t`` [M, 4] or [M, 2] (a thread's registers), each [M]."""
    if t.shape[1] == 2:
        return tl.split(t)
    else:
        even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        return c0, c1, c2, c3


@triton.jit
def zeros(zero, COUNT: tl.constexpr):
    """A tuple of COUNT ``zero``s (a tuple times a number is not repetition in jit code)."""
    out = ()
    for _ in tl.static_range(COUNT):
        out = out + (zero,)
    return out
