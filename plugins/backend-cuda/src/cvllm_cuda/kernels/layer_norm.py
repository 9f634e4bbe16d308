"""Residual add + LayerNorm (weight, optional bias) in one Triton launch: cvllm's LayerNorm.forward (Phi-2,
StableLM, GPT-NeoX-style layers) and, with a weight per head, the per-head LayerNorm of StableLM's q and k.

torch's LayerNorm kernels take a 16-bit input to fp32, normalise and apply the weight and bias there, and round
once to the input's dtype; the kernel rounds in the same place. The residual sum is rounded to the activations'
dtype first (``x + residual`` in torch). What is left: the order of the fp32 sums (mean and variance, the
variance biased, as torch's) and torch's rsqrt against an IEEE 1/sqrt, last-bit effects in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.rms_norm import _as_3d
from cvllm_cuda.kernels.sizes import cdiv, next_power_of_2

_TILE_ELEMENTS = 4096   # as rms_norm.py: a row of a large hidden size per program, several short rows (heads)
_MAX_HIDDEN = 65536     # one program holds a whole row in registers


@triton.jit(do_not_specialize=["num_rows"])
def _add_layer_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, bias_ptr, out_ptr, new_residual_ptr,
    num_rows, inner_rows, hidden, eps,
    stride_xa, stride_xb, stride_ra, stride_rb,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, PER_HEAD: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    # rows are the leading dims flattened, row = a * inner_rows + b: a strided [A, B, N] view is read in place
    # (q's heads in a fused qkv output: b is the head, and PER_HEAD picks the weight row b)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    outer, inner = (rows // inner_rows).to(tl.int64), (rows % inner_rows).to(tl.int64)

    x = tl.load(x_ptr + (outer * stride_xa + inner * stride_xb)[:, None] + cols[None, :], mask=mask, other=0.0)
    dense_offsets = (rows64 * hidden)[:, None] + cols[None, :]  # outputs are fresh contiguous tensors
    if HAS_RESIDUAL:
        r_offsets = (outer * stride_ra + inner * stride_rb)[:, None] + cols[None, :]
        residual = tl.load(residual_ptr + r_offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)  # x + residual, in the dtype
        tl.store(new_residual_ptr + dense_offsets, x, mask=mask)
    xf = x.to(tl.float32)

    # mean, then the biased variance of the centred values (two passes over registers), IEEE division and sqrt
    n = tl.full((BLOCK_R,), hidden, tl.float32)
    mean = tl.math.div_rn(tl.sum(xf, axis=1), n)
    centred = tl.where(mask, xf - mean[:, None], 0.0)
    var = tl.math.div_rn(tl.sum(centred * centred, axis=1), n)
    rstd = tl.math.div_rn(tl.full((BLOCK_R,), 1.0, tl.float32), tl.math.sqrt_rn(var + eps))
    normed = centred * rstd[:, None]

    if PER_HEAD:
        w_offsets = (inner * hidden)[:, None] + cols[None, :]
        weight = tl.load(weight_ptr + w_offsets, mask=mask, other=0.0).to(tl.float32)
        out = normed * weight
    else:
        weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = normed * weight[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        out = out + bias[None, :]
    tl.store(out_ptr + dense_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                         bias: torch.Tensor | None, eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``LayerNorm.forward`` in one launch: ``layer_norm(x) * weight + bias``, or with ``residual``
    ``(layer_norm(x + residual) * weight + bias, x + residual)``, normalising over the last dim; the norm in
    ``x``'s dtype (fp32 inside, one rounding).

    A 2-D ``weight`` [H, N] is a weight per head: ``x`` is [..., H, N] and head h takes row h (StableLM's
    ``qk_layernorm``; no residual then). ``x`` and ``residual`` may be strided views with any number of leading
    dims; the results are new contiguous tensors, nothing is written into the inputs or read back to the host.
    """
    hidden = x.shape[-1]
    per_head = weight.dim() == 2
    if per_head:
        assert residual is None and bias is None and x.dim() >= 2 and x.shape[-2] == weight.shape[0], \
            (weight.shape, x.shape)
    assert weight.shape[-1] == hidden and weight.dim() in (1, 2), (weight.shape, x.shape)
    assert bias is None or bias.shape == (hidden,), (bias.shape, x.shape)
    assert hidden <= _MAX_HIDDEN, f"hidden size {hidden} > {_MAX_HIDDEN}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype, x.dtype)
        new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = x.numel() // hidden if hidden else 0
    if num_rows:
        x3 = _as_3d(x)
        r3 = _as_3d(residual) if residual is not None else x3
        block_n = next_power_of_2(hidden)
        block_r = min(max(1, _TILE_ELEMENTS // block_n), next_power_of_2(num_rows))
        weight = weight.contiguous()
        _add_layer_norm_kernel[(cdiv(num_rows, block_r),)](
            x3, r3, weight, bias.contiguous() if bias is not None else weight, out,
            new_residual if new_residual is not None else out,
            num_rows, x3.shape[1], hidden, eps,
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, PER_HEAD=per_head,
            BLOCK_R=block_r, BLOCK_N=block_n,
            num_warps=min(16, max(1, block_r * block_n // 512)),
            enable_fp_fusion=False,  # no FMA contraction: the products and sums round as torch's separate ops do
            **pdl.options(x.device),
        )
    return out if residual is None else (out, new_residual)
