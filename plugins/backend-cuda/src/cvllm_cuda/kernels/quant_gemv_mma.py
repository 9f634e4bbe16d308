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


BLOCKS = 4   # 16-feature blocks a warp: 64 features


def _unit_asm() -> str:
    """PTX for one lane's unit, accumulating: outputs $0-$15 (block b's c0-c3 at $4b..), $16-$17 (X of tokens 2 j,
    2 j + 1); inputs $18-$25 (block b's words of features g and g + 8 at $18+2b, $19+2b), $26-$29 (x's four bf16
    pairs (x0, x1), (x2, x3), (x4, x5), (x6, x7)), $30-$47 (the accumulators going in, as the outputs)."""
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    lines = [
        "{",
        ".reg .b32 mask, bias, one, t, a0, a1, a2, a3, xa, xb, xc, xd;",
        ".reg .f32 s2, s3;",
        "mov.b32 mask, 0x000F000F;", "mov.b32 bias, 0x43004300;", "mov.b32 one, 0x3F803F80;",
        "prmt.b32 xa, $26, $28, 0x5410;",   # (x0, x4)
        "prmt.b32 xb, $26, $28, 0x7632;",   # (x1, x5)
        "prmt.b32 xc, $27, $29, 0x5410;",   # (x2, x6)
        "prmt.b32 xd, $27, $29, 0x7632;",   # (x3, x7)
    ]
    for b in range(BLOCKS):
        lo, hi = f"${18 + 2 * b}", f"${19 + 2 * b}"
        d = ", ".join(f"${4 * b + i}" for i in range(4))
        c = ", ".join(f"${30 + 4 * b + i}" for i in range(4))
        lines += [   # nibbles (0, 4) and (1, 5) of features g and g + 8 -> 128 + q, then (2, 6) and (3, 7)
            f"lop3.b32 a0, {lo}, mask, bias, 0xEA;", f"lop3.b32 a1, {hi}, mask, bias, 0xEA;",
            f"shr.u32 t, {lo}, 4;", "lop3.b32 a2, t, mask, bias, 0xEA;",
            f"shr.u32 t, {hi}, 4;", "lop3.b32 a3, t, mask, bias, 0xEA;",
            f"{mma} {{{d}}}, {{a0, a1, a2, a3}}, {{xa, xb}}, {{{c}}};",
            f"shr.u32 t, {lo}, 8;", "lop3.b32 a0, t, mask, bias, 0xEA;",
            f"shr.u32 t, {hi}, 8;", "lop3.b32 a1, t, mask, bias, 0xEA;",
            f"shr.u32 t, {lo}, 12;", "lop3.b32 a2, t, mask, bias, 0xEA;",
            f"shr.u32 t, {hi}, 12;", "lop3.b32 a3, t, mask, bias, 0xEA;",
            f"{mma} {{{d}}}, {{a0, a1, a2, a3}}, {{xc, xd}}, {{{d}}};",
        ]
    lines += [   # X: a first operand of ones
        f"{mma} {{$16, $17, s2, s3}}, {{one, one, one, one}}, {{xa, xb}}, {{$46, $47, $46, $47}};",
        f"{mma} {{$16, $17, s2, s3}}, {{one, one, one, one}}, {{xc, xd}}, {{$16, $17, s2, s3}};",
        "}",
    ]
    return "\n".join(lines)


UNIT_ASM = tl.constexpr(_unit_asm())
UNIT_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 18 + ["r"] * 12 + ["f"] * 18))


@triton.jit
def _unit_mma(words, xw, acc, INTERPRET: tl.constexpr):
    """``acc`` (18 float32 [W * 32]: block b's c0-c3, then X of tokens 2 j, 2 j + 1) plus one unit's MMAs: ``words``
    (8 int32 [W * 32]: block b's words of features g, g + 8) and ``xw`` (x's 4 pairs), one element a thread (element
    e is warp e // 32's lane e % 32)."""
    if INTERPRET:
        return _unit_emulated(words, xw, acc)
    else:
        return tl.inline_asm_elementwise(UNIT_ASM, UNIT_CONSTRAINTS, words + xw + acc,
                                         dtype=(tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                                                tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                                                tl.float32, tl.float32, tl.float32, tl.float32, tl.float32,
                                                tl.float32, tl.float32, tl.float32),   # 18: no tuple repetition
                                         is_pure=True, pack=1)


@triton.jit
def _lanes(t):
    """[W * 32] -> [W, 8, 4]: (warp, g, j)."""
    return tl.reshape(t, (t.shape[0] // 32, 8, 4))


@triton.jit
def _x_values(xw):
    """Each lane's 8 x values, float32 [W, 8 (token g), 4 (j), 8 (input)], from its 4 bf16 pairs."""
    x0, x1, x2, x3 = xw
    pairs = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (x0.shape[0], 4))    # [W * 32, pair]
    low = (pairs << 16).to(tl.float32, bitcast=True)
    high = (pairs & -65536).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(low, high), (x0.shape[0] // 32, 8, 4, 8))


@triton.jit
def _by_token_pairs(d):
    """[W, 8 (feature g), 8 (token n)] -> the lanes' (token 2 j, token 2 j + 1) values, each [W * 32]."""
    even, odd = tl.split(tl.reshape(d, (d.shape[0], 8, 4, 2)))
    return tl.reshape(even, (d.shape[0] * 32,)), tl.reshape(odd, (d.shape[0] * 32,))


@triton.jit
def _feature_sums(word, x):
    """D[feature row][token] of one 8-feature half: sum over lanes j and inputs of (128 + q) x, [W, 8, 8]."""
    shifts = (tl.arange(0, 8) * 4)[None, None, None, :]
    v = (128 + ((_lanes(word)[:, :, :, None] >> shifts) & 15)).to(tl.float32)           # [w, g, j, i]
    return tl.sum(tl.sum(v[:, :, None, :, :] * x[:, None, :, :, :], axis=4), axis=3)     # [w, g, n]


@triton.jit
def _unit_emulated(words, xw, acc):
    """What UNIT_ASM's MMAs add, from the same lanes' registers (the interpreter's path)."""
    x = _x_values(xw)
    out = ()
    for b in tl.static_range(4):
        c0, c1 = _by_token_pairs(_feature_sums(words[2 * b], x))
        c2, c3 = _by_token_pairs(_feature_sums(words[2 * b + 1], x))
        out = out + (acc[4 * b] + c0, acc[4 * b + 1] + c1, acc[4 * b + 2] + c2, acc[4 * b + 3] + c3)
    x_sum = tl.sum(tl.sum(x, axis=3), axis=2)                                            # [w, token]
    x_sum = tl.broadcast_to(x_sum[:, None, :], (x.shape[0], 8, 8))
    s0, s1 = _by_token_pairs(x_sum)
    return out + (acc[16] + s0, acc[17] + s1)


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
