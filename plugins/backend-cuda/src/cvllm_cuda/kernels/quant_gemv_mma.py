"""The 4-bit GEMV on 16-bit activations (W4A16: GPTQ/AWQ's numerics) through tensor-core MMAs, for 1-8 rows of x.

Why: the float GEMV (quant_gemv.py) spends ~5.3 SASS instructions a weight (a shift, a masked or, a float FMA, and
x's conversions and sums), which caps it near 2.8 TB/s of 4-bit weights on an H200 (its issue rate), and GPTQ's batch
1 sits at 1.38x bf16 against the issue's 2.2x. A tensor core multiplies a 16 x 16 bf16 tile by 16 x 8 in one
instruction a warp, so the weights only have to become bf16: one masked or puts two nibbles into the mantissas of a
pair of 128.0 (``(w >> 4 i) & 0x000F000F | 0x43004300`` is 128 + q for nibbles i and i + 4), exactly, and the MMA
multiplies those pairs by x's bf16 pairs exactly into float32 sums. About one instruction a weight, no rounding of
the weights (Marlin rounds the dequantized weight to bf16; here q stays an integer and the factors apply in float32).

The MMA (``mma.sync.m16n8k16``, bf16 in, float32 out) is taken with x as its first operand (rows: up to 8 tokens;
rows 8-15 zero) and the weight as its second (8 output features a block), reading the planes as they are
(quant_planes.py: word w of feature n holds inputs 8 w .. 8 w + 7, features contiguous). Lane t of a warp is
(g, j) = (t // 4, t % 4); for one "unit" of 32 inputs at k0 and 32 features at n0 it loads

- the words of inputs k0 + 8 j .. k0 + 8 j + 7 of features n0 + 4 g .. n0 + 4 g + 3 (16 bytes: the warp reads four
  128-byte rows of the plane), one word a block b = 0..3: block b's 8 features are n0 + 4 g' + b (g' = 0..7);
- x[g, k0 + 8 j .. k0 + 8 j + 7] (16 bytes; zero for rows past T).

In the MMA's numbering lane (g, j) holds, for the second operand, column g's inputs 2 j, 2 j + 1 (register b0) and
2 j + 8, 2 j + 9 (b1), and for the first, row g's inputs at the same indices (a0, a2). The inputs are permuted the
same way on both sides: the first MMA of a word takes its nibbles (0, 4) as (2 j, 2 j + 1) and (1, 5) as
(2 j + 8, 2 j + 9), with x's pairs (x0, x4) and (x1, x5); the second the nibbles (2, 6), (3, 7) with (x2, x6),
(x3, x7). Two MMAs a word and block, then lane (g, j) holds row g's sums for columns 2 j and 2 j + 1 (c0, c1):
features n0 + 8 j + b and n0 + 8 j + 4 + b. Two more MMAs with a second operand of ones give each row's sum of x,
X. A scale group's units are summed, then its factors apply in float32:

    y += scale * sum((128 + q) x) + (offset - 128 scale) * X,    the layout's value q * scale + offset.

Layouts: 4-bit planes without a high plane whose scale groups are whole multiples of 32 inputs (GPTQ/AWQ at every
group size, Q4_0, Q4_1, Q4_K), bf16 x (``applies``). Off by default (``CVLLM_GEMV_MMA=1``, read at import) until timed
on a GPU. In Triton's interpreter the MMAs are computed from the same lanes' registers by broadcasting (the same sums
in another order): the lanes' bookkeeping is tested on a CPU, the PTX on a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import gpu
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.quant_tiles import add_splits, kernel_tensors, word_factors
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

ENABLED = os.environ.get("CVLLM_GEMV_MMA", "0") == "1"
MAX_ROWS = 8            # rows of x: the MMA's first operand rows 0-7 (8-15 stay zero)
UNIT = 32               # inputs a lane's four words span (8 each): one unit
MAX_GROUP_UNITS = 4     # units a K step takes at most (GPTQ g128: a scale group a step)
# (warps a program: a warp 64 features, warps an SM the K split aims at) by rows of x. On the H200 (2026-12-06,
# bench/mma_gemv_probe.py, GPTQ-4bit g128, a Llama-3-8B layer's four GEMVs): 1 row 61.9 us with (4, 32) against 67.7
# at 16 warps an SM, 68.9 at 64 and 77.3 with quant_tiles.k_splits (its splits at least four K steps long: 5.8
# warps an SM on qkv); 8 rows 77.3 us with (1, 16) against 91.3 for (4, 16). 2-7 rows are not measured apart
TILES = {1: (4, 32)}
TILES_MORE_ROWS = (1, 16)


MMA = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                   "{$8, $9}, {$10, $11, $12, $13};")
ONES = tl.constexpr(0x3F803F80)       # a bf16 pair of 1.0
BIAS = tl.constexpr(0x43004300)       # a bf16 pair of 128.0: its mantissas' low 4 bits take a nibble each


@triton.jit
def _mma(a, b, c, INTERPRET: tl.constexpr):
    """d = A B + C of one ``mma.sync.m16n8k16`` (bf16 in, float32 out) from the lanes' fragments: ``a`` 4 int32
    (bf16 pairs), ``b`` 2, ``c`` 4 float32, each [W * 32] (element e is warp e // 32's lane e % 32). Lane (g, j) =
    (e % 32 // 4, e % 4) holds A[g][2j, 2j+1] (a0), A[g+8][2j, 2j+1] (a1), A[g][2j+8, 2j+9] (a2), A[g+8][2j+8, 2j+9]
    (a3), B[2j, 2j+1][g] (b0), B[2j+8, 2j+9][g] (b1), and C / D[g][2j, 2j+1] (c0, c1), [g+8][2j, 2j+1] (c2, c3)."""
    if INTERPRET:
        return _mma_emulated(a, b, c)
    else:
        return tl.inline_asm_elementwise(MMA, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", a + b + c,
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True,
                                         pack=1)


@triton.jit
def _pair_values(p):
    """The two bf16 of pairs ``p`` (int32 [W * 32]) as float32 [W, 8 (g), 4 (j), 2], low half first."""
    low = (p << 16).to(tl.float32, bitcast=True)
    high = (p & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(low, high), (p.shape[0] // 32, 8, 4, 2))


@triton.jit
def _join_k(first, second):
    """[W, 8, 4, 2] values at inputs (2j, 2j+1) and (2j+8, 2j+9) -> [W, 8, 4, 4] in that order."""
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 2, 4, 3)), (first.shape[0], 8, 4, 4))


@triton.jit
def _mma_emulated(a, b, c):
    """What ``_mma`` computes, from the same lanes' registers (Triton's interpreter; the sums in another order)."""
    top = _join_k(_pair_values(a[0]), _pair_values(a[2]))        # A's row g:     [w, g, j, k]
    bottom = _join_k(_pair_values(a[1]), _pair_values(a[3]))     # A's row g + 8
    cols = _join_k(_pair_values(b[0]), _pair_values(b[1]))       # B's column g:  [w, g, j, k]
    d_top = tl.sum(tl.sum(top[:, :, None, :, :] * cols[:, None, :, :, :], axis=4), axis=3)      # [w, row, column]
    d_bottom = tl.sum(tl.sum(bottom[:, :, None, :, :] * cols[:, None, :, :, :], axis=4), axis=3)
    c0, c1 = _by_column_pairs(d_top)
    c2, c3 = _by_column_pairs(d_bottom)
    return c[0] + c0, c[1] + c1, c[2] + c2, c[3] + c3


@triton.jit
def _by_column_pairs(d):
    """[W, 8 (row g), 8 (column n)] -> the lanes' columns 2 j and 2 j + 1 of row g, each [W * 32]."""
    even, odd = tl.split(tl.reshape(d, (d.shape[0], 8, 4, 2)))
    return tl.reshape(even, (d.shape[0] * 32,)), tl.reshape(odd, (d.shape[0] * 32,))


@triton.jit
def _nibble_pairs(word, SHIFT: tl.constexpr, INTERPRET: tl.constexpr):
    """The bf16 pair 128 + q of nibbles SHIFT / 4 and SHIFT / 4 + 4 of ``word``: ``(word >> SHIFT) & 0x000F000F |
    0x43004300``, exact (compiled: one ``lop3`` with both constants in registers, and the shift)."""
    moved = word >> SHIFT if SHIFT else word       # arithmetic: the mask drops the copied sign bits
    if INTERPRET:
        return (moved & 0x000F000F) | BIAS
    else:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [moved, tl.full(moved.shape, 0x000F000F, tl.int32),
                                          tl.full(moved.shape, BIAS, tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _halves(a, b, HIGH: tl.constexpr, INTERPRET: tl.constexpr):
    """The pair of ``a``'s and ``b``'s low (or HIGH) halves, ``a``'s first (compiled: one ``prmt``)."""
    if INTERPRET:
        if HIGH:
            return ((a >> 16) & 0xFFFF) | (b & -65536)
        else:
            return (a & 0xFFFF) | (b << 16)
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x7632;" if HIGH else "prmt.b32 $0, $1, $2, 0x5410;",
                                         "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _x_pairs(x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """x's pairs in the MMA's input order from a lane's (x0, x1), (x2, x3), (x4, x5), (x6, x7): (x0, x4), (x1, x5),
    (x2, x6), (x3, x7)."""
    return (_halves(x0, x2, False, INTERPRET), _halves(x0, x2, True, INTERPRET), _halves(x1, x3, False, INTERPRET),
            _halves(x1, x3, True, INTERPRET))


@triton.jit
def _unit_mma(words, xw, acc, INTERPRET: tl.constexpr):
    """``acc`` (18 float32 [W * 32]: block b's c0-c3, then X of tokens 2 j, 2 j + 1) plus one unit's MMAs: ``words``
    (8 int32 [W * 32]: block b's words of features g, g + 8) and ``xw`` (x's 4 pairs as loaded). The first MMA of a
    block takes nibbles (0, 4) as inputs (2 j, 2 j + 1) and (1, 5) as (2 j + 8, 2 j + 9), with x's pairs (x0, x4) and
    (x1, x5); the second nibbles (2, 6), (3, 7) with (x2, x6), (x3, x7). X: two MMAs with a first operand of ones."""
    xa, xb, xc, xd = _x_pairs(xw[0], xw[1], xw[2], xw[3], INTERPRET)
    out = ()
    for b in tl.static_range(4):
        lo = words[2 * b]
        hi = words[2 * b + 1]
        c = (acc[4 * b], acc[4 * b + 1], acc[4 * b + 2], acc[4 * b + 3])
        c = _mma((_nibble_pairs(lo, 0, INTERPRET), _nibble_pairs(hi, 0, INTERPRET), _nibble_pairs(lo, 4, INTERPRET),
                  _nibble_pairs(hi, 4, INTERPRET)), (xa, xb), c, INTERPRET)
        c = _mma((_nibble_pairs(lo, 8, INTERPRET), _nibble_pairs(hi, 8, INTERPRET), _nibble_pairs(lo, 12, INTERPRET),
                  _nibble_pairs(hi, 12, INTERPRET)), (xc, xd), c, INTERPRET)
        out = out + c
    ones = tl.full(xa.shape, ONES, tl.int32)
    s = _mma((ones, ones, ones, ones), (xa, xb), (acc[16], acc[17], acc[16], acc[17]), INTERPRET)
    s = _mma((ones, ones, ones, ones), (xc, xd), s, INTERPRET)
    return out + (s[0], s[1])


@triton.jit
def _gemv_mma_kernel(x_ptr, out_ptr, partial_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, N, K, T,
                     SPLIT_WORDS, SCALE_GROUP: tl.constexpr, SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr,
                     B_MODE: tl.constexpr, B_CONST: tl.constexpr, HAS_M: tl.constexpr, KU: tl.constexpr,
                     W: tl.constexpr, STAGES: tl.constexpr, EVEN_N: tl.constexpr, INTERPRET: tl.constexpr,
                     USE_PDL: tl.constexpr, WIDE: tl.constexpr = True):
    """Program (i, s): output features i * 64 W ... over words s * SPLIT_WORDS ...: a warp 64 features (4 blocks of
    16), KU units a K step (within one scale group). x is read as int32 bf16 pairs [T, K / 2] at ``x_ptr``. With
    more than one split, each stores float32 partial sums [splits, T, N], added by sum_splits_kernel.

    Every tensor is [W * 32], one element a thread, in its lane's order: Triton's layout of a 1-D tensor whose
    addresses are not contiguous puts element e in lane e % 32 of warp e // 32, which the MMAs' operands rely on
    (a compile test holds it)."""
    e = tl.arange(0, W * 32)
    g = (e % 32) // 4
    j = e % 4
    n0 = tl.program_id(0) * (64 * W) + (e // 32) * 64
    start = tl.program_id(1) * SPLIT_WORDS
    end = tl.minimum(K // 8, start + SPLIT_WORDS)
    # lane (g, j) reads word k0 / 8 + j of its 8 features; block b's rows g and g + 8 are its features 2 b, 2 b + 1
    # (_feature: WIDE, n0 + 8 g + h, two 16-byte loads a row; else n0 + 8 h + g, eight 4-byte loads)
    low_ptrs = low_ptr + (start + j) * N + _feature(n0, g, 0, WIDE)
    # x's pairs: token g's inputs k0 + 8 j + 2 p, + 1 at int32 (k0 + 8 j) / 2 + p
    x_ptrs = x_ptr + g * (K // 2) + start * 4 + 4 * j
    x_ok = g < T
    four = tl.arange(0, 4)[None, :]
    zero = tl.zeros((W * 32,), dtype=tl.float32)
    y = _zeros(zero, 16)
    wait_for_previous_kernel(USE_PDL)
    for w0 in tl.range(start, end, KU * 4, num_stages=STAGES):
        acc = _zeros(zero, 18)
        for u in tl.static_range(KU):
            rows = low_ptrs + u * 4 * N
            if WIDE:   # [W * 32, 4] tensors: Triton's layout keeps a row in a thread (16 bytes), rows in lane order
                first = rows[:, None] + four
                if EVEN_N:
                    words = _unstack4(tl.load(first)) + _unstack4(tl.load(first + 4))
                else:
                    f4 = n0[:, None] + 8 * g[:, None] + four
                    words = (_unstack4(tl.load(first, mask=f4 < N, other=0))
                             + _unstack4(tl.load(first + 4, mask=f4 + 4 < N, other=0)))
                xw = _unstack4(tl.load(x_ptrs[:, None] + u * 16 + four, mask=x_ok[:, None], other=0))
            else:
                words = ()
                for h in tl.static_range(8):
                    if EVEN_N:
                        words = words + (tl.load(rows + 8 * h),)
                    else:
                        words = words + (tl.load(rows + 8 * h, mask=n0 + 8 * h + g < N, other=0),)
                xu = x_ptrs + u * 16
                xw = (tl.load(xu, mask=x_ok, other=0), tl.load(xu + 1, mask=x_ok, other=0),
                      tl.load(xu + 2, mask=x_ok, other=0), tl.load(xu + 3, mask=x_ok, other=0))
            acc = _unit_mma(words, xw, acc, INTERPRET)
        new_y = ()
        for h in tl.static_range(8):   # lane (g, j)'s c0, c1 (feature row g) and c2, c3 (g + 8) of block h // 2
            f = _feature(n0, g, h, WIDE)
            scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, w0 * 8, f, None if EVEN_N else f < N, N,
                                         SCALE_GROUP, SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
            base = offset - 128.0 * scale
            # acc's c0 (c2 for h odd) of block h // 2 is acc[4 (h // 2) + 2 (h % 2)] = acc[2 h] (a constexpr
            # assigned to a name in jit code becomes a tensor: the index stays an expression)
            new_y = new_y + (y[2 * h] + scale * acc[2 * h] + base * acc[16],
                             y[2 * h + 1] + scale * acc[2 * h + 1] + base * acc[17])
        y = new_y
        low_ptrs += KU * 4 * N
        x_ptrs += KU * 16
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    for h in tl.static_range(8):
        f = _feature(n0, g, h, WIDE)
        _store(out_ptr, partial_ptr, y[2 * h], 2 * j, f, split, splits, T, N)
        _store(out_ptr, partial_ptr, y[2 * h + 1], 2 * j + 1, f, split, splits, T, N)


@triton.jit
def _feature(n0, g, h, WIDE: tl.constexpr):
    """The output feature of lane row g's word h (block h // 2, row g + 8 (h % 2))."""
    if WIDE:
        return n0 + 8 * g + h
    else:
        return n0 + 8 * h + g


@triton.jit
def _unstack4(t):
    """The columns of ``t`` [M, 4] (a thread's four registers), each [M]."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))
    c0, c2 = tl.split(even)
    c1, c3 = tl.split(odd)
    return c0, c1, c2, c3


@triton.jit
def _zeros(zero, COUNT: tl.constexpr):
    """A tuple of COUNT ``zero``s (a tuple times a number is not repetition in jit code)."""
    out = ()
    for _ in tl.static_range(COUNT):
        out = out + (zero,)
    return out


@triton.jit
def _store(out_ptr, partial_ptr, y, row, f, split, splits, T, N):
    ok = (row < T) & (f < N)
    if splits > 1:
        tl.store(partial_ptr + (split * T + row) * N + f, y, mask=ok)
    else:
        tl.store(out_ptr + row * N + f, y.to(out_ptr.dtype.element_ty), mask=ok)


def group_units(layout: QuantLayout) -> int:
    """Units (32 inputs) a K step takes: the most, up to MAX_GROUP_UNITS, that divide a scale group."""
    units = layout.scale_group // UNIT
    ku = MAX_GROUP_UNITS
    while units % ku:
        ku //= 2
    return ku


def applies(layout: QuantLayout, dtype: torch.dtype, in_features: int) -> bool:
    """Whether this GEMV can take a weight in ``layout`` times x of ``dtype``."""
    return (layout.low_bits == 4 and not layout.high_bits and not layout.float8 and dtype == torch.bfloat16
            and layout.scale_group % UNIT == 0 and in_features % (UNIT * group_units(layout)) == 0)


def split_count(n: int, k: int, ku: int, warps: int, warps_per_sm: int, device: torch.device) -> int:
    """K splits so that about ``warps_per_sm`` warps run an SM, each split one K step (KU units) at least."""
    columns = cdiv(n, 64 * warps)
    steps = k // (UNIT * ku)
    if device.type != "cuda":
        return 1 if steps < 2 else 2   # the interpreter: both paths
    return max(1, min(steps, cdiv(warps_per_sm * gpu.num_sms(gpu.device_index(device)), columns * warps)))


def quant_gemv_mma(x: torch.Tensor, weight: QuantWeight, out: torch.Tensor, warps: int | None = None,
                   splits: int | None = None, stages: int = 1) -> None:
    """out = x @ W.T for x [T, K] bf16 (T <= MAX_ROWS) and out [T, N]."""
    t, k = x.shape
    n = weight.out_features
    if t > MAX_ROWS or not applies(weight.layout, x.dtype, k):
        raise ValueError(f"quant_gemv_mma takes up to {MAX_ROWS} rows of bf16 x and 4-bit lane layouts")
    lay = weight.layout
    ku = group_units(lay)
    default_warps, warps_per_sm = TILES.get(t, TILES_MORE_ROWS)
    warps = warps or default_warps
    if splits is None:
        splits = split_count(n, k, ku, warps, warps_per_sm, x.device)
    split_words = cdiv(k // (UNIT * ku), splits) * ku * 4
    splits = cdiv(k // 8, split_words)
    x = x if x.is_contiguous() else x.contiguous()
    target = out if out.is_contiguous() else torch.empty((t, n), dtype=out.dtype, device=out.device)
    partials = target if splits == 1 else torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
    args = lay.kernel_args()
    block_n = 64 * warps
    _gemv_mma_kernel[(cdiv(n, block_n), splits)](
        x.view(torch.int32), target, partials, *kernel_tensors(weight), n, k, t, split_words,
        SCALE_GROUP=args["SCALE_GROUP"], SUPER_GROUP=args["SUPER_GROUP"], A_MODE=args["A_MODE"],
        B_MODE=args["B_MODE"], B_CONST=args["B_CONST"], HAS_M=args["HAS_M"], KU=ku, W=warps, STAGES=stages,
        EVEN_N=n % block_n == 0, INTERPRET=bool(triton.knobs.runtime.interpret), num_warps=warps,
        **pdl_options(x.device))
    if splits > 1:
        add_splits(partials, target, splits, n)
    if target is not out:
        out.copy_(target)
