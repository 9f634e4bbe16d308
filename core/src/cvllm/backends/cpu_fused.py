"""The CPU backend's ``fused_add_rms_norm`` and ``rotary`` (two of Backend's optional fused kernels): small bf16
inputs (decode rows) go to the C kernels of cpu_kernels.py; anything else (float32: the exact path, prefill chunks,
partial or interleaved rotary) is declined with None, and the layer runs its own torch code (backends/base.py)."""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from cvllm.backends.cpu_kernels import MAX_ROWS

logger = logging.getLogger(__name__)
MIN_COLS = 16   # narrower rows take torch's scalar sum, in another order than the kernel's


def _small_bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def make_fused_kernels(lib) -> dict:
    """{name: function} to set on the backend, given the loaded kernels (cpu_kernels.load())."""

    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        cols = weight.shape[0]
        rows = x.numel() // cols if cols else 0
        operands = (x, weight) if residual is None else (x, residual, weight)
        if weight.dim() != 1 or x.shape[-1] != cols or cols < MIN_COLS or not 0 < rows <= MAX_ROWS \
                or not _small_bf16(*operands) or (residual is not None and residual.shape != x.shape):
            return None
        out = torch.empty_like(x)
        summed = None if residual is None else torch.empty_like(x)
        lib.add_rms_norm_bf16(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              out.data_ptr(), None if summed is None else summed.data_ptr(), rows, cols, eps)
        return out if residual is None else (out, summed)

    def rotary(positions, q, k, cos_sin, head_dim, interleaved=False):
        rows = q.shape[0]
        if interleaved or cos_sin.shape[1] != head_dim or not 0 < rows <= MAX_ROWS or q.dim() != 2 \
                or q.stride(-1) != 1 or q.dtype != torch.bfloat16 or cos_sin.dtype != torch.bfloat16 \
                or not cos_sin.is_contiguous() or positions.dtype != torch.int64 or positions.numel() != rows \
                or (k is not None and (k.dim() != 2 or k.stride() != q.stride() or k.dtype != q.dtype)):
            return None
        positions = positions.contiguous()
        q_out = q.new_empty(q.shape)
        k_out = None if k is None else k.new_empty(k.shape)
        lib.rotary_bf16(q.data_ptr(), None if k is None else k.data_ptr(), q.stride(0), q_out.data_ptr(),
                        None if k_out is None else k_out.data_ptr(), rows, q.shape[1] // head_dim,
                        0 if k is None else k.shape[1] // head_dim, head_dim, positions.data_ptr(),
                        cos_sin.data_ptr())
        return q_out, k_out

    kernels = {"rotary": rotary}
    # CVLLM_CPU_FUSED_NORM=0: the layers' torch norm (an A/B); otherwise the C norm where it is bit-equal to torch's
    if os.environ.get("CVLLM_CPU_FUSED_NORM", "1") != "0" and _norm_matches_torch(fused_add_rms_norm):
        kernels["fused_add_rms_norm"] = fused_add_rms_norm
    return kernels


def _norm_matches_torch(fused_add_rms_norm) -> bool:
    """Whether the C norm gives RMSNorm's torch numbers bit for bit in this process (its sum of squares follows the
    order of torch's sum kernel, cpu_kernels.py; a torch whose kernel adds in another order would break that, and
    the kernel would flip near-tie tokens): a few hundred random rows of a few widths, a millisecond or two."""
    gen = torch.Generator().manual_seed(0)
    for cols in (16, 579, 2048 + 24 + 5):
        x, residual = (torch.randn(2, 64, cols, generator=gen) * 4).bfloat16()
        x[:, 3] *= 40
        weight = torch.randn(cols, generator=gen).bfloat16()
        out, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
        expected = weight * F.rms_norm(x + residual, weight.shape, eps=1e-6)
        if not (torch.equal(out, expected) and torch.equal(summed, x + residual)):
            logger.warning("the C add + RMSNorm is not bit-equal to torch %s's here: the layers run the torch norm",
                           torch.__version__)
            return False
    return True
