"""RMSNorm (and Gemma's 1 + weight variant) and LayerNorm (and a per-head one), each with an optional fused residual
add, computed as Hugging Face does. Inside a forward pass each calls its backend's fused kernel where the backend has
one (``fused_add_rms_norm``, ``fused_add_rms_norm_plus_one``, ``fused_add_layer_norm``) and its torch code
otherwise."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.backends.base import forward_backend


class RMSNorm(nn.Module):
    # the backend's fused kernel that computes this class's _norm (with the residual add)
    _fused_kernel = "fused_add_rms_norm"
    # whether it may be used: a subclass that changes _norm (e.g. a (1 + weight) scale) must name the kernel that
    # computes its own _norm beside it (GemmaRMSNorm), else it runs its torch code
    _fusable = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        norm_owner = next(k for k in cls.__mro__ if "_norm" in vars(k))
        kernel_owner = next(k for k in cls.__mro__ if "_fused_kernel" in vars(k))
        cls._fusable = cls.forward is RMSNorm.forward and norm_owner is kernel_owner

    # the linear layer the model hands this norm's output to (layers/decoder.feed), for a backend that makes that
    # layer's input form in the norm's launch (Backend.takes_feeds); None: not known
    feeds: nn.Module | None = None

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
        backend = forward_backend()
        fused = getattr(backend, self._fused_kernel, None) if self._fusable else None
        if fused is not None:
            feeds = {"feeds": self.feeds} if self.feeds is not None and backend.takes_feeds else {}
            if (out := fused(x, residual, self.weight, self.eps, **feeds)) is not None:
                return out   # (None: the kernel does not take these inputs, backends/base.py)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Scales by ``1 + weight`` (Gemma's: checkpoints store the offset from 1, HF initialises the weight to zeros).
    As transformers computes it: normalised and scaled in fp32, rounded once (``(x * w).to(dtype)``, not
    ``x.to(dtype) * w``); the backend's ``fused_add_rms_norm_plus_one`` computes this, the plain RMSNorm's fused
    kernel does not."""

    _fused_kernel = "fused_add_rms_norm_plus_one"

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with a weight and (by default) a bias, as ``nn.LayerNorm`` computes it (``F.layer_norm`` in the
    input's dtype: the same kernel transformers calls), with RMSNorm's optional fused residual add (Phi-2,
    StableLM, GPT-NeoX style models)."""

    # whether the backend's fused_add_layer_norm computes this class's forward (not a subclass's own forward)
    _fusable = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._fusable = cls.forward is LayerNorm.forward

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        backend = forward_backend() if self._fusable else None
        fused = getattr(backend, "fused_add_layer_norm", None)
        if fused is not None:
            return fused(x, residual, self.weight, self.bias, self.eps)
        if residual is not None:
            x = x + residual
        out = F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        return out if residual is None else (out, x)


def layer_norm_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A LayerNorm (weight, no bias) over each head of ``x`` [..., H * D] with a weight of its own per head,
    ``weight`` [H, D] (StableLM's ``qk_layernorm``): in fp32 and rounded once at the end, as nn.LayerNorm's kernel
    computes a low-precision input. The backend's ``fused_add_layer_norm`` takes the 2-D weight as per-head."""
    heads = x.reshape(-1, *weight.shape)   # [T, H, D]
    fused = getattr(forward_backend(), "fused_add_layer_norm", None)
    if fused is not None:
        return fused(heads, None, weight, None, eps).reshape(x.shape)
    normed = F.layer_norm(heads.float(), weight.shape[-1:], eps=eps) * weight.float()
    return normed.to(x.dtype).reshape(x.shape)
