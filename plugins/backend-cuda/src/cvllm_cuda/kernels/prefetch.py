"""L2 prefetches of a GEMV's first weight tiles before its PDL wait (``CVLLM_GEMV_PREFETCH=N``, N tiles; 0 = off).

Why: with PDL a batch-1 GEMV's programs sit on the SMs at ``griddepcontrol.wait`` while the kernel before it (a norm,
the attention's split combination, silu: ~2 us each) finishes, and the memory system is nearly idle then: ~8 MB of
the H200's copy rate a gap. The early weights (quant_tiles.EARLY_WEIGHTS) fill only the registers of the first K
step. ``prefetch.global.L2`` asks for a line without a register, a wait or a fault, so each program can ask for its
next N tiles' words and factors too, and its first steps after the wait read them from the L2. Weights only: no
kernel launched with PDL writes them (quant_tiles.EARLY_WEIGHTS says why that is safe). A hint: the same bits with
or without it; the interpreter skips it.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

PREFETCH_TILES = int(os.environ.get("CVLLM_GEMV_PREFETCH", "0"))
if PREFETCH_TILES & (PREFETCH_TILES - 1):
    raise ValueError(f"CVLLM_GEMV_PREFETCH must be 0 or a power of two (tiles), got {PREFETCH_TILES}")


@triton.jit
def prefetch_l2(ptrs, INTERPRET: tl.constexpr):
    """Asks the L2 for the lines holding ``ptrs`` (kept there ahead of other lines: evict_last); nothing waits."""
    if not INTERPRET:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(ptr, first, end, col0, N, lane, COUNT: tl.constexpr, COLS: tl.constexpr, LANES: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Prefetches rows ``first`` .. ``first + COUNT`` (clamped below ``end``) of a [rows, N] plane, columns ``col0``
    .. ``col0 + COLS`` (clamped below N): a line a row per 32 elements (one for narrower elements or tiles). LANES 0:
    as a [COUNT, lines] tensor; else as [LANES] tensors (``lane``: 0 .. LANES), for a kernel whose every tensor is
    one element a lane (quant_gemv_mma.py)."""
    LINES: tl.constexpr = (COLS + 31) // 32
    if COUNT > 0:
        if LANES == 0:
            rows = tl.minimum(first + tl.arange(0, COUNT), end - 1)
            cols = tl.minimum(col0 + tl.arange(0, LINES) * 32, N - 1)
            prefetch_l2(ptr + rows[:, None] * N + cols[None, :], INTERPRET)
        else:
            for i in tl.static_range((COUNT * LINES + LANES - 1) // LANES):
                line = tl.minimum(i * LANES + lane, COUNT * LINES - 1)
                rows = tl.minimum(first + line // LINES, end - 1)
                cols = tl.minimum(col0 + line % LINES * 32, N - 1)
                prefetch_l2(ptr + rows * N + cols, INTERPRET)


@triton.jit
def prefetch_weights(w0, num_words, col0, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, lane,
                     WORDS: tl.constexpr, COLS: tl.constexpr, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr,
                     SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr,
                     B_MODE: tl.constexpr, HAS_M: tl.constexpr, LANES: tl.constexpr, INTERPRET: tl.constexpr):
    """L2 prefetches of a low-bit weight's (quant_planes.py) WORDS low-plane word rows from ``w0`` (below
    ``num_words``), the high-plane words and the factor rows they use, columns ``col0`` .. ``col0 + COLS``
    (prefetch_rows' ``lane`` and LANES)."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    first, last = w0 * PER_WORD, num_words * PER_WORD - 1   # the inputs they span
    prefetch_rows(low_ptr, w0, num_words, col0, N, lane, WORDS, COLS, LANES, INTERPRET)
    if HIGH_BITS > 0:
        WORDS_PER_HIGH: tl.constexpr = LOW_BITS // HIGH_BITS
        prefetch_rows(high_ptr, w0 // WORDS_PER_HIGH, (num_words - 1) // WORDS_PER_HIGH + 1, col0, N, lane,
                      WORDS // WORDS_PER_HIGH, COLS, LANES, INTERPRET)
    SUPER_ROWS: tl.constexpr = (WORDS * PER_WORD + SUPER_GROUP - 1) // SUPER_GROUP
    prefetch_rows(d_ptr, first // SUPER_GROUP, last // SUPER_GROUP + 1, col0, N, lane, SUPER_ROWS, COLS, LANES,
                  INTERPRET)
    if HAS_M:
        prefetch_rows(m_ptr, first // SUPER_GROUP, last // SUPER_GROUP + 1, col0, N, lane, SUPER_ROWS, COLS, LANES,
                      INTERPRET)
    GROUP_ROWS: tl.constexpr = (WORDS * PER_WORD + SCALE_GROUP - 1) // SCALE_GROUP
    if A_MODE != 0:
        prefetch_rows(a_ptr, first // SCALE_GROUP, last // SCALE_GROUP + 1, col0, N, lane, GROUP_ROWS, COLS, LANES,
                      INTERPRET)
    if B_MODE == 2:
        prefetch_rows(b_ptr, first // SCALE_GROUP, last // SCALE_GROUP + 1, col0, N, lane, GROUP_ROWS, COLS, LANES,
                      INTERPRET)
