"""How a linear layer stores and applies its weight.

vLLM's interface: a ``LinearMethod`` creates the layer's parameters, may repack them after
loading, and applies the matmul. Quantizer plugins (GGUF, Marlin) provide their own methods;
model code never changes.

Methods are attached to a built model (gpt-fast's order): the model is built on the meta device
with unquantized layers, then ``attach_linear_methods`` swaps each linear layer's method before
anything is materialised, so model files hold no quantization plumbing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from cvllm.backends.base import forward_backend

logger = logging.getLogger(__name__)


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
        return dense(x, layer.weight, bias)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, or the running backend's own matmul for it (Backend.linear: the CUDA backend's GEMV)."""
    backend = forward_backend()
    if backend is not None and backend.linear is not None:
        return backend.linear(x, weight, bias)
    return F.linear(x, weight, bias)


# (layer name, the checkpoint module names whose rows it holds) -> a method, or None to stay unquantized.
# A plain layer has one source (its own name); a fused one several ("...qkv_proj" holds the rows of
# "...q_proj", "...k_proj" and "...v_proj"), so a quantizer can check they agree.
LinearMethodFactory = Callable[[str, Sequence[str]], "LinearMethod | None"]


def fused_sources(packed_modules_mapping: dict[str, tuple[str, object]]) -> dict[str, list[str]]:
    """``{"q_proj": ("qkv_proj", "q"), ...}`` inverted: fused module -> its checkpoint modules, in order."""
    sources: dict[str, list[str]] = {}
    for source, (fused, _shard) in packed_modules_mapping.items():
        sources.setdefault(fused, []).append(source)
    return sources


def attach_linear_methods(model: nn.Module, factory: LinearMethodFactory) -> int:
    """Give every linear layer of a (meta-device) model the method ``factory`` picks; returns how many
    layers changed. Linear layers are the modules with ``set_quant_method``."""
    fused = fused_sources(getattr(model, "packed_modules_mapping", None) or {})
    changed = 0
    for name, module in model.named_modules():
        if not hasattr(module, "set_quant_method"):
            continue
        parent, _, leaf = name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        method = factory(name, [prefix + source for source in fused.get(leaf, [leaf])])
        if method is not None:
            module.set_quant_method(method)
            changed += 1
    return changed


# MoE routers: "mlp.gate" (Qwen2/3-MoE, DeepSeek), "block_sparse_moe.gate" (Mixtral), Qwen2-MoE's
# "shared_expert_gate". In situ quantization leaves them float, as quantized releases and llama.cpp's quantize
# (ffn_gate_inp) do: they are small, and routing is sensitive to their rounding.
MOE_ROUTER_NAMES = ("gate", "shared_expert_gate")


def is_moe_router(layer: str) -> bool:
    return layer.rpartition(".")[2] in MOE_ROUTER_NAMES


def isq_quantizer(isq: str, installed) -> str:
    """The quantizer that performs in-situ quantization to ``isq``: one registered as ``isq-<type>`` (e.g.
    "isq-gptq" for ``--isq gptq``) where a plugin provides it, else the general "isq" one (the GGUF types)."""
    specific = f"isq-{isq.lower()}"
    return specific if specific in installed else "isq"


QUANT_KERNELS_ENV = "CVLLM_QUANT_KERNELS"
_kernels_missing: list[str] = []


def plane_kernels_usable(device: torch.device) -> bool:
    """Whether quantized layers on ``device`` compute with the CUDA backend's low-bit kernels
    (``cvllm_cuda.kernels.quant_matmul``, every quantization plugin's): a CUDA device, ``CVLLM_QUANT_KERNELS`` not
    "0", and the kernels importable. Without cvllm-cuda or triton (logged once) the layers load dequantized."""
    if device.type != "cuda" or os.environ.get(QUANT_KERNELS_ENV, "1") == "0":
        return False
    try:
        import cvllm_cuda.kernels.quant_matmul  # noqa: F401
    except ImportError as exc:
        if not _kernels_missing:
            _kernels_missing.append(str(exc))
            logger.warning("quantized layers on CUDA load dequantized: the low-bit kernels need cvllm-cuda and "
                           "triton (%s)", exc)
        return False
    return True

