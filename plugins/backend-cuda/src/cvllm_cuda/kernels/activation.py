"""SiLU(gate) * up and GELU(gate) * up over a fused gate+up projection, each in one Triton launch (cvllm's
SiluAndMul and GeluAndMul, fused; GeLU-gated MLPs are Gemma's), with torch's roundings (gate_math.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl, quant_gemv_int8
from cvllm_cuda.kernels.gate_math import GELU_APPROXIMATIONS, LIBDEVICE, SILU, gated, store_with_int8
from cvllm_cuda.kernels.load_order import joined
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

_BLOCK = 1024  # output features per program


@triton.jit
def _gated_kernel(
    x_ptr, out_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, intermediate, stride_xt,
    ACT: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr, INT8_BITS: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * stride_xt + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    gate = joined(gate, up)   # (up's load issued with gate's, not after the activation: load_order.py)
    out = gated(gate, up, out_ptr.dtype.element_ty, ACT, LIBDEVICE)
    store_with_int8(out_ptr, out, token, tl.program_id(1), mask, intermediate, packs_ptr, xd_ptr, sums_ptr,
                    block_sums_ptr, BLOCK, INT8_BITS)


def _gated_and_mul(x: torch.Tensor, act: int, feeds) -> torch.Tensor:
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
    _gated_kernel[grid](
        rows, out, *made, intermediate, rows.stride(0), ACT=act, LIBDEVICE=LIBDEVICE,
        BLOCK=min(_BLOCK, next_power_of_2(intermediate)), INT8_BITS=int8_bits, num_warps=4, enable_fp_fusion=False,
        **pdl.options(x.device),
    )
    if int8_bits:
        quant_gemv_int8.hand_over(out, feeds, int8_bits, made)
    return out


def silu_and_mul(x: torch.Tensor, feeds=None) -> torch.Tensor:
    """``silu(gate) * up`` with ``gate, up = x.chunk(2, dim=-1)``: ``[..., 2I]`` -> a new ``[..., I]`` tensor.
    ``feeds``: the linear layer the output goes to next (SiluAndMul.feeds); where that is a low-bit GEMV on int8
    activations, the output's int8 form comes with it (int8_activations.py)."""
    return _gated_and_mul(x, SILU, feeds)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", feeds=None) -> torch.Tensor:
    """``gelu(gate, approximate) * up`` with ``gate, up = x.chunk(2, dim=-1)``: ``[..., 2I]`` -> a new ``[..., I]``
    tensor; ``approximate`` as F.gelu's ("none" or "tanh"); ``feeds`` as silu_and_mul's."""
    assert approximate in GELU_APPROXIMATIONS, approximate
    return _gated_and_mul(x, GELU_APPROXIMATIONS[approximate], feeds)
