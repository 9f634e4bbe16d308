"""One warp's ``mma.sync.m16n8k16`` (bf16 in, float32 out) from Triton tensors of one element a thread, and the bf16
pairs its operands take from 4-bit words and from x (quant_gemv_mma.py's kernel).

A [W * 32] tensor whose addresses are not contiguous has Triton's layout of element e in lane e % 32 of warp e // 32
(and a [W * 32, 4] tensor of 16-byte rows keeps a row a lane): an elementwise PTX snippet then sees each lane's
registers as its fragment of the MMA. Lane (g, j) = (e % 32 // 4, e % 4) holds A[g][2j, 2j+1] (a0), A[g+8][2j, 2j+1]
(a1), A[g][2j+8, 2j+9] (a2), A[g+8][2j+8, 2j+9] (a3), B[2j, 2j+1][g] (b0), B[2j+8, 2j+9][g] (b1), and C / D[g][2j,
2j+1] (c0, c1), [g+8][2j, 2j+1] (c2, c3). In Triton's interpreter the MMA is computed from those same registers by
broadcasting (the sums in another order), so a CPU test checks which value sits in which lane and register.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cvllm_cuda.kernels.int8_bytes import _byte_perm
from cvllm_cuda.kernels.quant_gemv import _and_or

MMA = tl.constexpr("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, "
                   "{$8, $9}, {$10, $11, $12, $13};")
ONES = tl.constexpr(0x3F803F80)       # a bf16 pair of 1.0
BIAS = tl.constexpr(0x43004300)       # a bf16 pair of 128.0: its mantissas' low 4 bits take a nibble each


@triton.jit
def mma(a, b, c, INTERPRET: tl.constexpr):
    """D = A B + C from the lanes' fragments (the module's docstring): ``a`` 4 int32 (bf16 pairs), ``b`` 2, ``c`` 4
    float32, each [W * 32]; returns D's 4."""
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
    """What ``mma`` computes, from the same lanes' registers (Triton's interpreter; the sums in another order)."""
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
def nibble_pairs(word, SHIFT: tl.constexpr, INTERPRET: tl.constexpr):
    """The bf16 pair 128 + q of nibbles SHIFT / 4 and SHIFT / 4 + 4 of ``word``: ``(word >> SHIFT) & 0x000F000F |
    0x43004300``, exact (compiled: the shift and one ``lop3``, quant_gemv._and_or)."""
    moved = word >> SHIFT if SHIFT else word       # arithmetic: the mask drops the copied sign bits
    if INTERPRET:
        return (moved & 0x000F000F) | BIAS
    else:
        return _and_or(moved, 0x000F000F, BIAS)


@triton.jit
def x_pairs(x0, x1, x2, x3, INTERPRET: tl.constexpr):
    """x's pairs in the MMA's input order from a lane's (x0, x1), (x2, x3), (x4, x5), (x6, x7): (x0, x4), (x1, x5),
    (x2, x6), (x3, x7) (one ``prmt`` each: low halves 0x5410, high halves 0x7632)."""
    return (_byte_perm(x0, x2, 0x5410, INTERPRET), _byte_perm(x0, x2, 0x7632, INTERPRET),
            _byte_perm(x1, x3, 0x5410, INTERPRET), _byte_perm(x1, x3, 0x7632, INTERPRET))
