"""Residual add + RMSNorm + weight multiply in one Triton launch (cvllm's RMSNorm.forward, fused).

The numbers follow the torch code of ``cvllm.layers.layernorm.RMSNorm`` (Hugging Face's): the residual
sum is rounded to the activations' dtype, the norm is computed in fp32 and rounded to that dtype,
and the weight product is rounded again (to the promoted dtype, as ``weight * normed`` is). The only
difference left is the order of the fp32 sum of squares, a last-bit effect in fp32.

Gemma's norm (``cvllm.layers.layernorm.GemmaRMSNorm``) scales by ``1 + weight`` and, as transformers computes it,
multiplies the unrounded fp32 norm by ``1 + weight`` in fp32 and rounds once, to the activations' dtype:
``fused_add_rms_norm_plus_one``, the same kernel with ``PLUS_ONE``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl, quant_gemv_int8, quant_tiles
from cvllm_cuda.kernels.int8_activations import quantize_blocks
from cvllm_cuda.kernels.pdl import launch_next_kernel, wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

# Elements of one program's tile: a row of a large model's hidden size per program, several rows
# of a per-head norm (Qwen3's q_norm over 128 features) per program.
_TILE_ELEMENTS = 4096
_MAX_HIDDEN = 65536  # one program holds a whole row in registers


# num_rows changes every eager step: specialising on it (== 1, divisible by 16) would compile new
# variants while serving, each costing the step it first appears in ~0.5 s
@triton.jit(do_not_specialize=["num_rows"])
def _add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr,
    num_rows, inner_rows, hidden, eps,
    stride_xa, stride_xb, stride_ra, stride_rb,
    HAS_RESIDUAL: tl.constexpr, PLUS_ONE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    INT8_BITS: tl.constexpr, USE_PDL: tl.constexpr, EARLY: tl.constexpr = False, LATE_TRIGGER: tl.constexpr = False,
):
    cols = tl.arange(0, BLOCK_N)
    # The norm's weight is read with x, not after the sum of squares (which cost a second round trip to memory), and
    # with EARLY before the PDL wait: no kernel writes weights (quant_tiles.EARLY_WEIGHTS)
    if EARLY:
        weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    wait_for_previous_kernel(USE_PDL, LATE_TRIGGER)
    if not EARLY:
        weight = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    # rows are the leading dims flattened: row = a * inner_rows + b, so a strided [A, B, N] view
    # (per-head q of a fused qkv output) is read in place
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols < hidden)[None, :]
    rows64 = rows.to(tl.int64)
    outer, inner = (rows // inner_rows).to(tl.int64), (rows % inner_rows).to(tl.int64)

    x_offsets = (outer * stride_xa + inner * stride_xb)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
    dense_offsets = (rows64 * hidden)[:, None] + cols[None, :]  # outputs are fresh contiguous tensors
    if HAS_RESIDUAL:
        r_offsets = (outer * stride_ra + inner * stride_rb)[:, None] + cols[None, :]
        residual = tl.load(residual_ptr + r_offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)  # x + residual, in the dtype
        tl.store(new_residual_ptr + dense_offsets, x, mask=mask)
    launch_next_kernel(USE_PDL, LATE_TRIGGER)   # (pdl.LATE_TRIGGER: x and the residual are in)
    xf = x.to(tl.float32)

    # mean of squares and 1/sqrt in fp32 with IEEE division and square root (not the approximate
    # instructions Triton uses for '/' and sqrt): the closest a kernel gets to torch's numbers
    sum_sq = tl.sum(xf * xf, axis=1)
    mean_sq = tl.math.div_rn(sum_sq, tl.full(sum_sq.shape, hidden, tl.float32))
    rstd = tl.math.div_rn(tl.full(sum_sq.shape, 1.0, tl.float32), tl.math.sqrt_rn(mean_sq + eps))
    if PLUS_ONE:  # Gemma: the fp32 norm times (1 + weight) in fp32, one rounding
        out = (xf * rstd[:, None]) * (1.0 + weight[None, :])
    else:
        normed = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # torch rounds the norm to the dtype
        out = weight[None, :] * normed
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + dense_offsets, out, mask=mask)
    if INT8_BITS > 0:   # the output's int8 form for the low-bit GEMV it goes to (int8_activations.py)
        BLOCKS: tl.constexpr = BLOCK_N // 32
        blocks = tl.arange(0, BLOCKS)
        flat_blocks = tl.reshape(rows64[:, None] * (hidden // 32) + blocks[None, :], (BLOCK_R * BLOCKS,))
        ok = tl.reshape(row_ok[:, None] & (blocks < hidden // 32)[None, :], (BLOCK_R * BLOCKS,))
        quantize_blocks(tl.reshape(out.to(tl.float32), (BLOCK_R * BLOCKS, 32)), flat_blocks, ok,
                        packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, INT8_BITS)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[A, B, N]`` (a view where possible): the kernel reads rows at ``a * stride0 + b * stride1``."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       feeds=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm.forward`` in one launch: ``weight * rms_norm(x)``, or with ``residual``
    ``(weight * rms_norm(x + residual), x + residual)``, normalising over the last dim.

    ``x`` and ``residual`` may be strided views with any number of leading dims; the results are new
    contiguous tensors (no writes into the inputs: safe inside CUDA graphs and autograd-free code
    alike). Nothing is read back to the host. ``feeds``: the linear layer the output goes to next (RMSNorm.feeds);
    where that is a low-bit GEMV on int8 activations, the output's int8 form comes with it (int8_activations.py).
    """
    return _launch(x, residual, weight, eps, plus_one=False, feeds=feeds)


def fused_add_rms_norm_plus_one(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                                feeds=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``GemmaRMSNorm.forward`` in one launch: ``rms_norm(x) * (1 + weight)`` in fp32, rounded once to ``x``'s
    dtype, or with ``residual`` ``(that of x + residual, x + residual)``; inputs as ``fused_add_rms_norm``'s."""
    return _launch(x, residual, weight, eps, plus_one=True, feeds=feeds)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            plus_one: bool, feeds=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, x.shape)
    assert hidden <= _MAX_HIDDEN, f"hidden size {hidden} > {_MAX_HIDDEN}"
    out_dtype = x.dtype if plus_one else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    new_residual = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype, x.dtype)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // hidden if hidden else 0
    int8_bits, made = quant_gemv_int8.output_form(out, feeds, num_rows)
    if num_rows:
        x3 = _as_3d(x)
        r3 = _as_3d(residual) if residual is not None else x3
        block_n = next_power_of_2(hidden)
        block_r = min(max(1, _TILE_ELEMENTS // block_n), next_power_of_2(num_rows))
        grid = (cdiv(num_rows, block_r),)
        _add_rms_norm_kernel[grid](
            x3, r3, weight.contiguous(), out, new_residual if new_residual is not None else out, *made,
            num_rows, x3.shape[1], hidden, eps,
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            HAS_RESIDUAL=residual is not None, PLUS_ONE=plus_one, BLOCK_R=block_r, BLOCK_N=block_n,
            INT8_BITS=int8_bits, num_warps=min(16, max(1, block_r * block_n // 512)),
            enable_fp_fusion=False,  # no FMA contraction: the products round as torch's do
            EARLY=quant_tiles.EARLY_WEIGHTS, LATE_TRIGGER=pdl.LATE_TRIGGER, **pdl.options(x.device),
        )
        if int8_bits:
            quant_gemv_int8.hand_over(out, feeds, int8_bits, made)
    return out if residual is None else (out, new_residual)
