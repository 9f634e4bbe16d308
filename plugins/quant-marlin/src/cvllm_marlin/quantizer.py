"""The "gptq" and "awq" quantizers: ``target(checkpoint, dtype)`` -> a factory of LinearMethods per linear layer.

``quantization_config`` comes from the checkpoint's config.json (core's HF reader sets ``quant_method`` from it and
keeps the whole config). A layer is quantized when the checkpoint holds ``<module>.qweight`` for its modules (read
from the safetensors headers, nothing else); a fused layer whose parts disagree is an error. Without headers to read
(a checkpoint that is not a directory of safetensors files) every linear layer is taken as quantized except AWQ's
``modules_to_not_convert``. A fused MoE layer whose experts the checkpoint quantizes gets moe.py's method (the
factory's ``moe_method``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.checkpoint.quantized import quantization_config, tensor_headers
from cvllm.layers.quantization import LinearMethod, LinearMethodFactory
from cvllm_marlin.config import QuantConfigError, modules_not_converted, parse_awq_config, parse_gptq_config
from cvllm_marlin.linear_method import AWQLinearMethod, GPTQLinearMethod
from cvllm_marlin.moe import PackedExpertsMethod


def quantized_modules(checkpoint: Checkpoint) -> set[str] | None:
    """Module names that have a ``.qweight`` tensor in the checkpoint's safetensors headers; None if unknown."""
    headers = tensor_headers(checkpoint)
    if headers is None:
        return None
    return {name.removesuffix(".qweight") for name in headers if name.endswith(".qweight")}


def _factory(checkpoint: Checkpoint, method_class, config, not_converted: list[str], dtype: torch.dtype) \
        -> LinearMethodFactory:
    present = quantized_modules(checkpoint)

    def moe_method(name: str, module) -> PackedExpertsMethod | None:
        """A FusedMoE layer ("...mlp.experts") whose experts the checkpoint quantizes keeps them in their groups."""
        if present is None:
            if any(part in name.split(".") for part in not_converted):
                return None
        elif f"{name}.0.gate_proj" not in present and f"{name}.{module.placement.start}.gate_proj" not in present:
            return None
        return PackedExpertsMethod(method_class.name, config, name)

    def method_for(layer: str, sources: Sequence[str]) -> LinearMethod | None:
        if present is None:
            if any(part in layer.split(".") or layer.endswith(part) for part in not_converted):
                return None
            return method_class(config, dtype, layer)
        quantized = [source in present for source in sources]
        if not any(quantized):
            return None
        if not all(quantized):
            listed = ", ".join(f"{s} {'quantized' if q else 'float'}" for s, q in zip(sources, quantized))
            raise CheckpointError(f"{checkpoint.path}: layer '{layer}' fuses quantized and float weights "
                                  f"({listed}); such checkpoints are not supported")
        return method_class(config, dtype, layer)

    method_for.moe_method = moe_method
    return method_for


def gptq_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    return _linear_methods(checkpoint, dtype, parse_gptq_config, GPTQLinearMethod)


def awq_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    return _linear_methods(checkpoint, dtype, parse_awq_config, AWQLinearMethod)


def _linear_methods(checkpoint: Checkpoint, dtype: torch.dtype, parse, method_class) -> LinearMethodFactory:
    raw = quantization_config(checkpoint)
    try:
        config = parse(raw, f"{checkpoint.path}: quantization_config")
    except QuantConfigError as e:
        raise CheckpointError(str(e)) from None
    # GPTQ checkpoints carry no such list (modules_not_converted finds none); AWQ's names its float layers
    return _factory(checkpoint, method_class, config, modules_not_converted(raw), dtype)
