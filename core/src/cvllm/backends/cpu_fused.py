"""The CPU backend's ``fused_add_rms_norm`` and ``rotary`` (two of Backend's optional fused kernels): small bf16
inputs (decode rows) go to the C kernels of cpu_kernels.py, anything else (float32: the exact path, prefill chunks,
partial or interleaved rotary) to the same torch code the layers run without them."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from cvllm.backends.cpu_kernels import MAX_ROWS
from cvllm.layers.rotary import RotaryEmbedding, _side_by_side


def torch_rotary(positions, q, k, cos_sin, head_dim, interleaved=False):
    """RotaryEmbedding.forward's own torch code (its methods, on the table it passed): what runs without a kernel."""
    shape = SimpleNamespace(rotary_dim=cos_sin.shape[1], head_dim=head_dim)
    if interleaved:
        rows = cos_sin[positions]
        return (RotaryEmbedding._rotate_pairs(shape, q, rows),
                None if k is None else RotaryEmbedding._rotate_pairs(shape, k, rows))
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], dim=-1)[:, None], torch.cat([-sin, sin], dim=-1)[:, None]
    qk = None if k is None else _side_by_side(q, k)
    if qk is not None:
        return RotaryEmbedding._rotate(shape, qk, cos, sin).split([q.shape[-1], k.shape[-1]], dim=-1)
    return (RotaryEmbedding._rotate(shape, q, cos, sin),
            None if k is None else RotaryEmbedding._rotate(shape, k, cos, sin))


def _small_bf16(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def make_fused_kernels(lib) -> dict:
    """{name: function} to set on the backend, given the loaded kernels (cpu_kernels.load())."""

    def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
        cols = weight.shape[0]
        rows = x.numel() // cols if cols else 0
        operands = (x, weight) if residual is None else (x, residual, weight)
        if weight.dim() != 1 or x.shape[-1] != cols or not 0 < rows <= MAX_ROWS or not _small_bf16(*operands) \
                or (residual is not None and residual.shape != x.shape):
            if residual is None:
                return weight * F.rms_norm(x, weight.shape, eps=eps)
            x = x + residual
            return weight * F.rms_norm(x, weight.shape, eps=eps), x
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
            return torch_rotary(positions, q, k, cos_sin, head_dim, interleaved)
        positions = positions.contiguous()
        q_out = q.new_empty(q.shape)
        k_out = None if k is None else k.new_empty(k.shape)
        lib.rotary_bf16(q.data_ptr(), None if k is None else k.data_ptr(), q.stride(0), q_out.data_ptr(),
                        None if k_out is None else k_out.data_ptr(), rows, q.shape[1] // head_dim,
                        0 if k is None else k.shape[1] // head_dim, head_dim, positions.data_ptr(),
                        cos_sin.data_ptr())
        return q_out, k_out

    return {"fused_add_rms_norm": fused_add_rms_norm, "rotary": rotary}
