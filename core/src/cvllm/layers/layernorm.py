"""RMSNorm with an optional fused residual add (computed in fp32, as Hugging Face does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.backends.base import forward_backend


class RMSNorm(nn.Module):
    # whether the backend's fused_add_rms_norm computes this class's forward; a subclass that
    # changes _norm (e.g. a (1 + weight) scale) must not be handed to it
    _fusable = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fusable = cls._norm is RMSNorm._norm and cls.forward is RMSNorm.forward

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
        backend = forward_backend() if self._fusable else None
        fused = None if backend is None else backend.fused_add_rms_norm
        if fused is not None:
            return fused(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class LayerNorm(nn.Module):
    """LayerNorm with a weight and (by default) a bias, as ``nn.LayerNorm`` computes it (``F.layer_norm`` in the
    input's dtype: the same kernel transformers calls), with RMSNorm's optional fused residual add (Phi-2,
    StableLM, GPT-NeoX style models)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return out if residual is None else (out, x)
