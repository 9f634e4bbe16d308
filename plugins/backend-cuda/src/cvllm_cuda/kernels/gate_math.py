"""The gated activations' arithmetic (``silu(gate) * up``, ``gelu(gate) * up``) with torch's roundings, and the store
of their output with its int8 form, for the activation kernels (activation.py).

torch computes ``F.silu(gate)`` in fp32 as ``gate / (1 + exp(-gate))``, rounds it to the dtype, and the product with
``up`` rounds again; so do these. On the GPU exp comes from libdevice (the CUDA math library's expf, which torch's
CUDA kernel calls too) and the division rounds as IEEE's, rather than Triton's default approximate exp2 and division.
``F.gelu`` likewise, in fp32 with torch's formulas and constants: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
x**3)))`` for ``approximate="tanh"``, ``x * 0.5 * (1 + erf(x / sqrt(2)))`` for the exact one, tanh and erf from
libdevice as torch's CUDA kernel takes them (Triton's interpreter has no libdevice: numpy's erf, and tanh from exp).
The kernels that call these compile without FMA contraction (``enable_fp_fusion=False``), for the same roundings.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from cvllm_cuda.kernels.int8_activations import quantize_blocks

# Triton's CPU interpreter has no libdevice; it gets numpy's functions instead
LIBDEVICE = not triton.knobs.runtime.interpret
# the gated activations by the number the kernels take (ACT): 0 none
SILU, GELU, GELU_TANH = 1, 2, 3
GELU_APPROXIMATIONS = {"none": GELU, "tanh": GELU_TANH}

# F.gelu's constants as torch's CUDA kernel rounds them to fp32: sqrt(2) * (2 / sqrt(pi)) * 0.5, 0.044715, 1 / sqrt(2)
# (constexpr: a compiled kernel may read only constexpr globals; the interpreter reads any)
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)
_SQRT1_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def gated(gate, up, dtype: tl.constexpr, ACT: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``act(gate) * up`` in ``dtype`` for float32 ``gate`` and ``up`` holding values of ``dtype``."""
    if ACT == 1:
        if LIBDEVICE:
            exp_neg = libdevice.exp(-gate)
        else:
            exp_neg = tl.exp(-gate)
        act = tl.math.div_rn(gate, 1.0 + exp_neg)
    elif ACT == 3:
        beta = tl.full(gate.shape, _GELU_BETA, tl.float32)
        inner = beta * (gate + _GELU_KAPPA * (gate * gate * gate))
        if LIBDEVICE:
            tanh = libdevice.tanh(inner)
        else:  # the interpreter: 1 - 2 / (exp(2u) + 1) in fp64, rounded to fp32 as an fp32 tanh would be (the
            # tails need it: 1 + tanh(u) cancels for u < 0, and torch adds 1 to a correctly rounded tanh)
            u = inner.to(tl.float64)
            tanh = (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)).to(tl.float32)
        act = 0.5 * gate * (1.0 + tanh)
    else:
        scaled = gate * _SQRT1_2
        if LIBDEVICE:
            erf = libdevice.erf(scaled)
        else:  # the interpreter: fp64 rounded to fp32, for the same reason as tanh's
            erf = tl.math.erf(scaled.to(tl.float64)).to(tl.float32)
        act = gate * 0.5 * (1.0 + erf)
    act = act.to(dtype).to(tl.float32)   # F.silu and F.gelu round to the dtype before the product
    return (act * up).to(dtype)


@triton.jit
def store_with_int8(out_ptr, out, row, tile, ok, width, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr,
                    BLOCK: tl.constexpr, INT8_BITS: tl.constexpr):
    """``out`` [BLOCK], columns ``tile * BLOCK ...`` of row ``row`` of a [rows, width] output (``ok``: which to
    store), and where INT8_BITS is set their int8 form for the low-bit GEMV they go to (int8_activations.py; BLOCK a
    multiple of 32, so the columns are whole blocks of 32)."""
    tl.store(out_ptr + row * width + tile * BLOCK + tl.arange(0, BLOCK), out, mask=ok)
    if INT8_BITS > 0:
        BLOCKS: tl.constexpr = BLOCK // 32
        blocks = tile * BLOCKS + tl.arange(0, BLOCKS)
        block_ok = tl.reshape(ok, (BLOCKS, 32))
        block_ok = tl.max(block_ok.to(tl.int32), axis=1) > 0
        quantize_blocks(tl.reshape(out.to(tl.float32), (BLOCKS, 32)), row * (width // 32) + blocks, block_ok,
                        packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, INT8_BITS)
