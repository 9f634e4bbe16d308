"""How a linear layer stores and applies its weight.

vLLM's interface: a ``LinearMethod`` creates the layer's parameters, may repack them after
loading, and applies the matmul. Quantizer plugins (GGUF, Marlin) provide their own methods;
model code never changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
