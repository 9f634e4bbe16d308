"""The int8-activation GEMV's Triton kernel (quant_gemv_int8.py launches it and says how it works): integer dot
products of a low-bit weight tile's words with x rounded to int8 per 32 inputs, and its K splits."""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm_cuda.kernels.int8_bytes import weight_bytes
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_tiles import load_masked, word_factors


@triton.jit
def _dot4(a, b, c, INTERPRET: tl.constexpr):
    """c + the sum over the four bytes of the unsigned bytes of ``a`` times the signed bytes of ``b``."""
    if INTERPRET:
        for j in tl.static_range(4):
            c += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)   # arithmetic shift: sign-extended
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _row_step(acc, wbytes, scale, offset, pack_ptrs, xd_ptr, xsum_ptr, xblock_sum_ptr, words, gwords, word_ok,
              num_words, LOW_BITS: tl.constexpr, GROUP_WORDS: tl.constexpr, ONE_BLOCK: tl.constexpr,
              EVEN: tl.constexpr, INTERPRET: tl.constexpr):
    """One row of x's share of a K step: ``acc`` plus the tile's words (``wbytes``, their dp4a operands per phase,
    made once for all the rows) times the row's int8 packs, summed per group (ONE_BLOCK) or per word. The same
    operations for every row and every number of rows, so a row's output does not depend on the rows beside it."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    PHASES: tl.constexpr = 8 // LOW_BITS
    dots = tl.zeros(wbytes[0].shape, dtype=tl.int32)
    for s in tl.static_range(PHASES):
        pack = load_masked(pack_ptrs + s, word_ok, 0)
        dots = _dot4(wbytes[s], pack + tl.zeros_like(dots), dots, INTERPRET)
    if ONE_BLOCK:
        block = gwords // GROUP_WORDS
        block_ok = None if EVEN else gwords < num_words
        x_d = load_masked(xd_ptr + block, block_ok, 0.0)
        x_sum = load_masked(xblock_sum_ptr + block, block_ok, 0.0)
        acc += tl.sum(dots, axis=1, keep_dims=True).to(tl.float32) * (x_d * scale) + offset * x_sum
    else:
        x_d = load_masked(xd_ptr + words * PER_WORD // 32, word_ok, 0.0)
        x_sum = load_masked(xsum_ptr + words, word_ok, 0.0)
        acc += (dots.to(tl.float32) * x_d) * scale + offset * x_sum
    return acc


@triton.jit
def _weight_words(w0, low_ptrs, high_ptrs, tile_words, group_first, col_ok3, num_words, HIGH_BITS: tl.constexpr,
                  HIGH_PER_GROUP: tl.constexpr, EVEN: tl.constexpr):
    """The K step at word ``w0``'s low words (and high-plane words) [GROUPS, GROUP_WORDS, BLOCK_N]."""
    if EVEN:
        ok = None
        group_ok = None
    else:
        ok = ((w0 + tile_words) < num_words) & col_ok3
        group_ok = ((w0 + group_first)[:, None, None] < num_words) & col_ok3
    low = load_masked(low_ptrs, ok, 0)
    high = low
    if HIGH_BITS > 0:
        high = load_masked(high_ptrs, group_ok if HIGH_PER_GROUP else ok, 0)
    return low, high


@triton.jit
def _weight_factors(w0, d_ptr, m_ptr, a_ptr, b_ptr, group_first, cols3, col_ok3, num_words, N,
                    LOW_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr,
                    A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr, HAS_M: tl.constexpr,
                    EVEN: tl.constexpr):
    """The K step at word ``w0``'s factors, loaded as [GROUPS, 1, BLOCK_N] in the tile's own layout (loaded [GROUPS,
    BLOCK_N] they would be moved through shared memory every step, a barrier that stalls all the program's warps)."""
    gwords = (w0 + group_first)[:, None, None]
    group_ok = None if EVEN else (gwords < num_words) & col_ok3
    return word_factors(d_ptr, m_ptr, a_ptr, b_ptr, gwords * (32 // LOW_BITS), cols3, group_ok, N, SCALE_GROUP,
                        SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)


@triton.jit
def _tile_step(accs, wbytes, scale, offset, pack_ptrs, xd_ptr, xsum_ptr, xblock_sum_ptr, row_offsets, w0,
               tile_words, group_first, num_words, K, LOW_BITS: tl.constexpr, GROUP_WORDS: tl.constexpr,
               ONE_BLOCK: tl.constexpr, EVEN: tl.constexpr, INTERPRET: tl.constexpr, ROWS: tl.constexpr):
    """Every row's accumulator after the K step at word ``w0``: its words' bytes (weight_bytes, made once for all
    the rows) and factors times each row's int8 packs (_row_step)."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    words = w0 + tile_words
    gwords = (w0 + group_first)[:, None, None]
    word_ok = None if EVEN else words < num_words
    stepped = ()
    for r in tl.static_range(ROWS):
        at = row_offsets[r]
        stepped = stepped + (_row_step(accs[r], wbytes, scale, offset, pack_ptrs + at * (K // 4),
                                       xd_ptr + at * (K // 32), xsum_ptr + at * (K // PER_WORD),
                                       xblock_sum_ptr + at * (K // 32), words, gwords, word_ok, num_words,
                                       LOW_BITS, GROUP_WORDS, ONE_BLOCK, EVEN, INTERPRET),)
    return stepped


@triton.jit(do_not_specialize=["T", "stride_ot"])
def _gemv_int8_kernel(packs_ptr, xd_ptr, xsum_ptr, xblock_sum_ptr, out_ptr, partial_ptr, low_ptr, high_ptr,
                      d_ptr, m_ptr, a_ptr, b_ptr, N, K, SPLIT_WORDS, T, stride_ot,
                      LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                      SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                      HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                      GROUP_WORDS: tl.constexpr, GROUP_SUM: tl.constexpr, STAGES: tl.constexpr,
                      EVEN: tl.constexpr, INTERPRET: tl.constexpr, USE_PDL: tl.constexpr,
                      ROWS: tl.constexpr = 1, EARLY: tl.constexpr = False):
    """The float GEMV's tiling and splits (quant_matmul._gemv_kernel), integer dot products per word. Where a factor
    group is one activation block (32 inputs: Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0), the group's word products
    are added as integers and turned into a float once per group and column, not once per word. A high plane's
    words come with the low words' tile, one per factor group where a group is one high word (Q6_K, Q5_*), else
    one per low word (Q3_K), and each word's bytes are made once for all the rows (weight_bytes). ROWS rows of x a
    program, rows ``program_id(0) * ROWS`` on (a few rows: a decode batch, a speculative verify step): each weight
    tile is loaded and its factors computed once for all of them, and each row is summed as it is alone
    (_row_step), so a row's output does not depend on the others or on ROWS; the tiles and K splits depend on the
    weight only. A last program with fewer rows computes its last row again in their place and stores nothing for
    them. Out row t at ``t * stride_ot``; with K splits, split j's partial sums of row t at ``partial_ptr + (j * T +
    t) * N`` (float32), added by sum_splits_kernel. EARLY: the first K step's weights are read before the PDL wait
    (the same operations in the same order; the peeled step's float multiply-adds may be contracted otherwise:
    quant_tiles.EARLY_WEIGHTS)."""
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    PHASES: tl.constexpr = 8 // LOW_BITS
    GROUPS: tl.constexpr = BLOCK_W // GROUP_WORDS
    start = tl.program_id(2) * SPLIT_WORDS
    num_words = tl.minimum(K // PER_WORD, start + SPLIT_WORDS)
    first_row = tl.program_id(0) * ROWS
    packs_ptr += first_row * (K // 4)
    xd_ptr += first_row * (K // 32)
    xblock_sum_ptr += first_row * (K // 32)
    xsum_ptr += first_row * (K // PER_WORD)
    # each row's offset from the first (a last program's missing rows repeat its last row)
    row_offsets = (0,)
    for r in tl.static_range(1, ROWS):
        row_offsets = row_offsets + (tl.minimum(first_row + r, T - 1) - first_row,)
    # the tile's weight columns (output features) and which lie inside the weight
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols3 = cols[None, None, :]
    col_ok3 = col_ok[None, None, :]
    group_first = tl.arange(0, GROUPS) * GROUP_WORDS
    tile_words = group_first[:, None, None] + tl.arange(0, GROUP_WORDS)[None, :, None]   # [GROUPS, GROUP_WORDS, 1]
    ONE_BLOCK: tl.constexpr = GROUP_WORDS * PER_WORD == 32 and GROUP_SUM   # (quant_tiles.groups_in_thread)
    accs = ()
    for _ in tl.static_range(ROWS):
        accs = accs + (tl.zeros((GROUPS, 1 if ONE_BLOCK else GROUP_WORDS, BLOCK_N), dtype=tl.float32),)
    # pointers advanced a tile at a time (recomputing them from the word index was a quarter of the loop's
    # instructions); EVEN: every tile in bounds, no masks
    low_ptrs = low_ptr + (start + tile_words) * N + cols3                       # [GROUPS, GROUP_WORDS, BLOCK_N]
    pack_ptrs = packs_ptr + (start + tile_words) * PHASES                       # [GROUPS, GROUP_WORDS, 1]
    # a high-plane word spans LOW_BITS / HIGH_BITS low words (whole ones per tile and split: which part of it a
    # word holds is the same every step); where a factor group is one high word (Q6_K, Q5_*), it is loaded once
    # per group, [GROUPS, 1, BLOCK_N] as the factors are, else once per low word
    WORDS_PER_HIGH: tl.constexpr = LOW_BITS // HIGH_BITS if HIGH_BITS > 0 else 1
    HIGH_PER_GROUP: tl.constexpr = GROUP_WORDS == WORDS_PER_HIGH
    part = tile_words % WORDS_PER_HIGH
    high_ptrs = low_ptrs   # (no high plane: unused)
    if HIGH_BITS > 0:
        tl.static_assert(BLOCK_W % WORDS_PER_HIGH == 0, "a tile must hold whole high-plane words")
        if HIGH_PER_GROUP:
            high_ptrs = high_ptr + ((start + group_first) // WORDS_PER_HIGH)[:, None, None] * N + cols3
        else:
            high_ptrs = high_ptr + (start + tile_words) // WORDS_PER_HIGH * N + cols3
    if EARLY:
        # the first tile's words and factors (weights: no kernel writes them) read before waiting for the previous
        # kernel, so that their memory latency passes while it finishes (PDL: this grid's programs are already on
        # the SMs); x is read only after the wait
        low, high = _weight_words(start, low_ptrs, high_ptrs, tile_words, group_first, col_ok3, num_words,
                                  HIGH_BITS, HIGH_PER_GROUP, EVEN)
        scale, offset = _weight_factors(start, d_ptr, m_ptr, a_ptr, b_ptr, group_first, cols3, col_ok3, num_words,
                                        N, LOW_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, EVEN)
    wait_for_previous_kernel(USE_PDL)
    if EARLY:
        wbytes = weight_bytes(low, high, part, LOW_BITS, HIGH_BITS, INTERPRET)
        accs = _tile_step(accs, wbytes, scale, offset, pack_ptrs, xd_ptr, xsum_ptr, xblock_sum_ptr, row_offsets,
                          start, tile_words, group_first, num_words, K, LOW_BITS, GROUP_WORDS, ONE_BLOCK, EVEN,
                          INTERPRET, ROWS)
        low_ptrs += BLOCK_W * N
        pack_ptrs += BLOCK_W * PHASES
        if HIGH_BITS > 0:
            high_ptrs += BLOCK_W // WORDS_PER_HIGH * N
    # STAGES > 1: the next tiles' loads are issued while this one computes
    for w0 in tl.range(start + BLOCK_W * EARLY, num_words, BLOCK_W, num_stages=STAGES):
        low, high = _weight_words(w0, low_ptrs, high_ptrs, tile_words, group_first, col_ok3, num_words, HIGH_BITS,
                                  HIGH_PER_GROUP, EVEN)
        if HIGH_BITS > 0:
            high_ptrs += BLOCK_W // WORDS_PER_HIGH * N
        wbytes = weight_bytes(low, high, part, LOW_BITS, HIGH_BITS, INTERPRET)
        scale, offset = _weight_factors(w0, d_ptr, m_ptr, a_ptr, b_ptr, group_first, cols3, col_ok3, num_words, N,
                                        LOW_BITS, SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M, EVEN)
        accs = _tile_step(accs, wbytes, scale, offset, pack_ptrs, xd_ptr, xsum_ptr, xblock_sum_ptr, row_offsets,
                          w0, tile_words, group_first, num_words, K, LOW_BITS, GROUP_WORDS, ONE_BLOCK, EVEN,
                          INTERPRET, ROWS)
        low_ptrs += BLOCK_W * N
        pack_ptrs += BLOCK_W * PHASES
    splits = tl.num_programs(2)
    for r in tl.static_range(ROWS):
        row = first_row + r
        total = tl.sum(tl.sum(accs[r], axis=1), axis=0)
        if splits > 1:
            tl.store(partial_ptr + (tl.program_id(2) * T + row).to(tl.int64) * N + cols, total,
                     mask=col_ok & (row < T))
        else:
            tl.store(out_ptr + row.to(tl.int64) * stride_ot + cols, total.to(out_ptr.dtype.element_ty),
                     mask=col_ok & (row < T))
