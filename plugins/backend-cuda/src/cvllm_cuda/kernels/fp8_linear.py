"""Linear layers over FP8 (e4m3) weights with one float32 scale per output row (per-tensor and per-channel FP8
checkpoints, ``--isq fp8``), on Hopper's FP8 tensor cores.

- One row of x (the batch-1 decode step): the GEMV of kernels/gemv.py reading the e4m3 weight as it is stored
  ([N, K], one byte a weight, long contiguous rows) with x in its own dtype, the row scale applied to each sum
  (W8A16: the weights' bytes are the cost, so half of bf16's).
- More rows: W8A8 on the tensor cores, ``torch._scaled_mm`` (cuBLASLt) of the activations rounded to e4m3 with
  one scale per row of x computed on the fly (``max |x| / 448``, vLLM's dynamic per-token scheme) and the
  weight's per-row scales. Checkpoints' static ``input_scale`` are not used: a scale per token is at least as
  fine.

cuBLASLt needs K and N multiples of 16 (``usable``); other layers keep the low-bit planes (W8A16 everywhere).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.gemv import gemv
from cvllm_cuda.kernels.pdl import options as pdl_options
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel

E4M3_MAX = tl.constexpr(448.0)   # (a Triton constant: the kernel reads it)


def usable(weight: torch.Tensor) -> bool:
    """Whether a [N, K] e4m3 weight on ``weight.device`` can take this path: a CUDA device with FP8 tensor cores
    (compute capability 8.9 or later) and cuBLASLt's multiples of 16."""
    n, k = weight.shape
    return (weight.device.type == "cuda" and torch.cuda.get_device_capability(weight.device) >= (8, 9)
            and n % 16 == 0 and k % 16 == 0)


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, K, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Row i of x: its scale max|x| / 448 (at least the smallest normal float32) and x / scale in e4m3."""
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / E4M3_MAX, 1.1754943508222875e-38)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        ok = k + cols < K
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=ok, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.minimum(tl.maximum(x / scale, -E4M3_MAX), E4M3_MAX))
        tl.store(out_ptr + row * K + k + cols, q.to(tl.float8e4nv), mask=ok)


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: then the conversion
    to e4m3 is exact (Triton 3.6's interpreter rounds carries wrongly; the GPU's own rounding is this one)."""
    bits = v.to(tl.int32, bitcast=True)
    # normals: 3 mantissa bits, round at bit 20 of the float32's 23
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # below 2**-6 (e4m3's subnormals, steps of 2**-9): round v * 512 to an integer with float32's own rounding
    steps = tl.abs(v) * 512.0
    sub = ((steps + 8388608.0) - 8388608.0) / 512.0
    return tl.where(tl.abs(v) < 0.015625, tl.where(v < 0, -sub, sub), normal)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (last dimension contiguous) -> (e4m3 [T, K], float32 scales [T, 1]): x ~ q * scale per row."""
    t, k = x.shape
    q = torch.empty((t, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((t, 1), dtype=torch.float32, device=x.device)
    if t:
        _quantize_rows_kernel[(t,)](x, q, scales, k, x.stride(0), BLOCK=min(2048, triton.next_power_of_2(k)),
                                    num_warps=4, **pdl_options(x.device))
    return q, scales


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight * row_scale[:, None], bias)`` for x [..., K] in its dtype: ``weight`` e4m3 [N, K]
    (contiguous), ``row_scale`` float32 [N]."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.shape[0] == 1:
        return gemv(rows, weight, bias, scale=row_scale).view(*x.shape[:-1], n)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    q, scales = quantize_rows(rows)
    # rowwise scaling wants a bf16 output; the sums are float32 inside
    out = torch._scaled_mm(q, weight.t(), scale_a=scales, scale_b=row_scale.view(1, n), out_dtype=torch.bfloat16)
    if bias is not None:
        out += bias.to(out.dtype)
    return out.to(x.dtype).view(*x.shape[:-1], n)
