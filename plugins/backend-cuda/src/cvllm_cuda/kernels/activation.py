"""SiLU(gate) * up and GELU(gate) * up over a fused gate+up projection, each in one Triton launch (cvllm's
SiluAndMul and GeluAndMul, fused; GeLU-gated MLPs are Gemma's).

torch computes ``F.silu(gate)`` in fp32 as ``gate / (1 + exp(-gate))``, rounds it to the dtype, and the
product with ``up`` rounds again; the kernel rounds in the same places. On the GPU it takes exp from
libdevice (the CUDA math library's expf, which torch's CUDA kernel calls too) and divides with IEEE
rounding, rather than Triton's default approximate exp2 and division.

``F.gelu`` likewise, in fp32 with torch's formulas and constants: ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 *
x**3)))`` for ``approximate="tanh"``, ``x * 0.5 * (1 + erf(x / sqrt(2)))`` for the exact one, tanh and erf from
libdevice as torch's CUDA kernel takes them (Triton's interpreter has no libdevice: numpy's erf, and tanh from exp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from cvllm_cuda.kernels import int8_activations, pdl, quant_gemv_int8
from cvllm_cuda.kernels.int8_activations import quantize_blocks
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

_BLOCK = 1024  # output features per program
# Triton's CPU interpreter has no libdevice; it gets numpy's exp instead
_LIBDEVICE_EXP = not triton.knobs.runtime.interpret


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, intermediate, stride_xt,
    LIBDEVICE_EXP: tl.constexpr, BLOCK: tl.constexpr, INT8_BITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE_EXP:
        exp_neg = libdevice.exp(-gate)
    else:
        exp_neg = tl.exp(-gate)
    dtype = out_ptr.dtype.element_ty
    silu = tl.math.div_rn(gate, 1.0 + exp_neg).to(dtype).to(tl.float32)  # F.silu rounds to the dtype
    _store(out_ptr, (silu * up).to(dtype), token, cols, mask, intermediate, packs_ptr, xd_ptr, sums_ptr,
           block_sums_ptr, BLOCK, INT8_BITS)


@triton.jit
def _store(out_ptr, out, token, cols, mask, intermediate, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr,
           BLOCK: tl.constexpr, INT8_BITS: tl.constexpr):
    """A program's output columns, and where INT8_BITS is set their int8 form for the low-bit GEMV they go to
    (int8_activations.py; BLOCK a multiple of 32, so the program's columns are whole blocks of 32)."""
    tl.store(out_ptr + token * intermediate + cols, out, mask=mask)
    if INT8_BITS > 0:
        BLOCKS: tl.constexpr = BLOCK // 32
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        quantize_blocks(tl.reshape(out.to(tl.float32), (BLOCKS, 32)), token * (intermediate // 32) + blocks,
                        blocks < intermediate // 32, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, INT8_BITS)


def silu_and_mul(x: torch.Tensor, feeds=None) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``: ``[..., 2I]`` -> a new ``[..., I]`` tensor.
    ``feeds``: the linear layer the output goes to next (SiluAndMul.feeds); where that is a low-bit GEMV on int8
    activations, the output's int8 form comes with it (int8_activations.py)."""
    assert x.shape[-1] % 2 == 0, x.shape
    intermediate = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], intermediate), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, x.shape[-1])  # a view for the usual [T, 2I] or [B, S, 2I] projection output
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    int8_bits, made = quant_gemv_int8.output_form(out, feeds, rows.shape[0])
    grid = (rows.shape[0], cdiv(intermediate, _BLOCK))
    _silu_and_mul_kernel[grid](
        rows, out, *made, intermediate, rows.stride(0),
        LIBDEVICE_EXP=_LIBDEVICE_EXP, BLOCK=min(_BLOCK, next_power_of_2(intermediate)), INT8_BITS=int8_bits,
        num_warps=4, enable_fp_fusion=False, **pdl.options(x.device),
    )
    if int8_bits:
        int8_activations.attach(out, int8_bits, made)
    return out


# F.gelu's constants as torch's CUDA kernel rounds them to fp32: sqrt(2) * (2 / sqrt(pi)) * 0.5, 0.044715, 1 / sqrt(2)
# (constexpr: a compiled kernel may read only constexpr globals; the interpreter reads any)
_GELU_BETA = tl.constexpr(0.7978845608028654)
_GELU_KAPPA = tl.constexpr(0.044715)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
GELU_APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _gelu_and_mul_kernel(
    x_ptr, out_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, intermediate, stride_xt,
    TANH: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr, INT8_BITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        beta = tl.full(gate.shape, _GELU_BETA, tl.float32)
        inner = beta * (gate + _GELU_KAPPA * (gate * gate * gate))
        if LIBDEVICE:
            tanh = libdevice.tanh(inner)
        else:  # the interpreter: 1 - 2 / (exp(2u) + 1) in fp64, rounded to fp32 as an fp32 tanh would be (the
            # tails need it: 1 + tanh(u) cancels for u < 0, and torch adds 1 to a correctly rounded tanh)
            u = inner.to(tl.float64)
            tanh = (1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)).to(tl.float32)
        gelu = 0.5 * gate * (1.0 + tanh)
    else:
        scaled = gate * _SQRT1_2
        if LIBDEVICE:
            erf = libdevice.erf(scaled)
        else:  # the interpreter: fp64 rounded to fp32, for the same reason as tanh's
            erf = tl.math.erf(scaled.to(tl.float64)).to(tl.float32)
        gelu = gate * 0.5 * (1.0 + erf)
    dtype = out_ptr.dtype.element_ty
    gelu = gelu.to(dtype).to(tl.float32)  # F.gelu rounds to the dtype before the product
    _store(out_ptr, (gelu * up).to(dtype), token, cols, mask, intermediate, packs_ptr, xd_ptr, sums_ptr,
           block_sums_ptr, BLOCK, INT8_BITS)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", feeds=None) -> torch.Tensor:
    """``gelu(gate, approximate) * up`` with ``gate, up = x.chunk(2, dim=-1)``: ``[..., 2I]`` -> a new ``[..., I]``
    tensor; ``approximate`` as F.gelu's ("none" or "tanh"); ``feeds`` as silu_and_mul's."""
    assert approximate in GELU_APPROXIMATIONS, approximate
    assert x.shape[-1] % 2 == 0, x.shape
    intermediate = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], intermediate), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    int8_bits, made = quant_gemv_int8.output_form(out, feeds, rows.shape[0])
    grid = (rows.shape[0], cdiv(intermediate, _BLOCK))
    _gelu_and_mul_kernel[grid](
        rows, out, *made, intermediate, rows.stride(0),
        TANH=approximate == "tanh", LIBDEVICE=_LIBDEVICE_EXP, BLOCK=min(_BLOCK, next_power_of_2(intermediate)),
        INT8_BITS=int8_bits, num_warps=4, enable_fp_fusion=False, **pdl.options(x.device),
    )
    if int8_bits:
        int8_activations.attach(out, int8_bits, made)
    return out
