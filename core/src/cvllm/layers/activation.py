"""Gated activations over a fused gate+up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.backends.base import forward_backend


class SiluAndMul(nn.Module):
    feeds: nn.Module | None = None   # the layer its output goes to next, as RMSNorm.feeds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = forward_backend()
        if backend is not None and backend.silu_and_mul is not None:
            if self.feeds is not None and backend.takes_feeds:
                return backend.silu_and_mul(x, feeds=self.feeds)
            return backend.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` (GeGLU: Gemma's MLP); ``approximate`` as F.gelu's, "none" or "tanh". Inside a forward
    pass the backend's ``gelu_and_mul(x, approximate)`` where it has one."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    feeds: nn.Module | None = None   # the layer its output goes to next, as RMSNorm.feeds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        backend = forward_backend()
        fused = getattr(backend, "gelu_and_mul", None)
        if fused is not None:
            if self.feeds is not None and backend.takes_feeds:
                return fused(x, self.approximate, feeds=self.feeds)
            return fused(x, self.approximate)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
