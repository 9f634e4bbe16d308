"""Round-to-nearest GPTQ-style quantization of float weights, vectorised (on the weights' device: a GPU does an 8B
model's layers in seconds), for ``--isq gptq`` and ``cvllm convert``.

This is GPTQ's per-group quantizer without GPTQ's error-compensating updates: for each group of ``group_size``
consecutive inputs and each output, the range [min, max] of the weights, widened to include 0 (symmetric: to
[-a, a] with a the larger magnitude), gives an fp16 scale ``(max - min) / maxq`` and an integer zero (``(maxq + 1)
/ 2`` symmetric, ``round(-min / scale)`` otherwise); ``q = clamp(round(w / scale) + zero, 0, maxq)`` and the
weight becomes ``scale * (q - zero)``. Calibrated GPTQ (or AWQ) checkpoints keep more of the model's quality at the
same size; RTN at 4 bits with groups of 128 is the usual quick baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RTNWeight:
    q: torch.Tensor        # uint8 [out, in], 0 .. 2**bits - 1
    scales: torch.Tensor   # float16 [groups, out]
    zeros: torch.Tensor    # uint8 [groups, out]
    bits: int
    group_size: int        # the group actually used (in_features for -1)

    def dequantized(self) -> torch.Tensor:
        """float32 [out, in]: scale * (q - zero)."""
        out_features, in_features = self.q.shape
        groups = in_features // self.group_size
        q = self.q.to(torch.float32).view(out_features, groups, self.group_size)
        z = self.zeros.t().to(torch.float32).unsqueeze(-1)
        s = self.scales.t().to(torch.float32).unsqueeze(-1)
        return ((q - z) * s).view(out_features, in_features)


def quantize_rtn(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True) -> RTNWeight:
    """``weight`` float [out, in]; ``group_size`` -1: one group per row. ``in`` must be whole groups."""
    if bits not in (4, 8):
        raise ValueError(f"round-to-nearest quantization to {bits} bits is not supported (4 or 8)")
    out_features, in_features = weight.shape
    size = in_features if group_size == -1 else group_size
    if size <= 0 or in_features % size:
        raise ValueError(f"{in_features} input features are not whole groups of {group_size}")
    maxq = (1 << bits) - 1
    w = weight.to(torch.float32).view(out_features, in_features // size, size)
    lo = w.amin(-1).clamp(max=0)
    hi = w.amax(-1).clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = torch.where(lo < 0, -hi, lo)
    empty = (lo == 0) & (hi == 0)   # an all-zero group: any scale works, GPTQ takes [-1, 1]
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = ((hi - lo) / maxq).to(torch.float16)
    scale = torch.where(scale == 0, torch.finfo(torch.float16).tiny, scale)   # a range below fp16's: not 0
    if sym:
        zero = torch.full_like(lo, (maxq + 1) // 2)
    else:
        zero = torch.round(-lo / scale.float()).clamp(0, maxq)
    q = (torch.round(w / scale.float().unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, maxq)
    return RTNWeight(q.view(out_features, in_features).to(torch.uint8), scale.t().contiguous(),
                     zero.to(torch.uint8).t().contiguous(), bits, size)
