"""RMSNorm with an optional fused residual add (computed in fp32, as Hugging Face does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused rms_norm computes in fp32 whatever the input dtype and rounds once at the end:
        # the same numbers as HF's (x.float() * rsqrt(mean(x²) + eps)).to(dtype), in one op
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
