"""The "fp8", "compressed-tensors" and "isq-fp8" quantizers: ``target(checkpoint, dtype)`` -> a factory of
LinearMethods per linear layer.

A checkpoint layer is FP8 when its ``<module>.weight`` is F8_E4M3 in the safetensors headers (read, nothing else);
without headers to read, every linear layer but the config's ignored ones. A fused layer mixing FP8 and float
parts is refused. A fused MoE layer whose experts are FP8 keeps them FP8 (moe.py; the factory's ``moe_method``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
from torch import nn

from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.checkpoint.quantized import quantization_config, tensor_headers
from cvllm.layers.embedding import ParallelLMHead
from cvllm.layers.quantization import LinearMethod, LinearMethodFactory, is_moe_router
from cvllm_fp8.config import FP8Config, FP8ConfigError, parse_compressed_tensors_config, parse_fp8_config
from cvllm_fp8.head import LM_HEAD_ENV, FP8HeadMethod, head_choice
from cvllm_fp8.linear_method import FP8LinearMethod
from cvllm_fp8.moe import FP8ExpertsMethod

logger = logging.getLogger(__name__)


def fp8_modules(checkpoint: Checkpoint) -> set[str] | None:
    """Modules whose ``.weight`` is F8_E4M3 in the checkpoint's safetensors headers; None if unknown."""
    headers = tensor_headers(checkpoint)
    if headers is None:
        return None
    return {name.removesuffix(".weight") for name, info in headers.items()
            if name.endswith(".weight") and isinstance(info, dict) and info.get("dtype") == "F8_E4M3"}


def _factory(checkpoint: Checkpoint, config: FP8Config) -> LinearMethodFactory:
    present = fp8_modules(checkpoint)

    def ignored(layer: str) -> bool:
        return any(layer == name or layer.endswith("." + name) or name in layer.split(".") for name in config.ignore)

    def moe_method(name: str, module) -> FP8ExpertsMethod | None:
        """A FusedMoE layer ("...mlp.experts") whose experts the checkpoint stores in FP8 keeps them FP8."""
        if present is None:
            return None if ignored(name) else FP8ExpertsMethod(config, name)
        first = (f"{name}.0.gate_proj", f"{name}.{module.placement.start}.gate_proj")
        return FP8ExpertsMethod(config, name) if any(stem in present for stem in first) else None

    def method_for(layer: str, sources: Sequence[str]) -> LinearMethod | None:
        if present is None:
            return None if ignored(layer) else FP8LinearMethod(config, layer)
        fp8 = [source in present for source in sources]
        if not any(fp8):
            return None
        if not all(fp8):
            listed = ", ".join(f"{s} {'fp8' if q else 'float'}" for s, q in zip(sources, fp8))
            raise CheckpointError(f"{checkpoint.path}: layer '{layer}' fuses FP8 and float weights ({listed}); "
                                  f"such checkpoints are not supported")
        return FP8LinearMethod(config, layer)

    method_for.moe_method = moe_method
    return method_for


def _parsed(checkpoint: Checkpoint, parse) -> FP8Config:
    try:
        return parse(quantization_config(checkpoint), f"{checkpoint.path}: quantization_config")
    except FP8ConfigError as e:
        raise CheckpointError(str(e)) from None


def fp8_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    return _factory(checkpoint, _parsed(checkpoint, parse_fp8_config))


def compressed_tensors_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    return _factory(checkpoint, _parsed(checkpoint, parse_compressed_tensors_config))


def isq_fp8_linear_methods(checkpoint: Checkpoint, dtype: torch.dtype) -> LinearMethodFactory:
    """``--isq fp8``: every linear layer quantized per output row as its float shards load; an untied LM head too
    where CVLLM_ISQ_LM_HEAD=fp8 (head.py; float by default)."""
    head = head_choice(os.environ.get(LM_HEAD_ENV))   # a misspelt choice fails here, before anything loads

    def method_for(layer: str, sources: Sequence[str]) -> LinearMethod | None:
        return None if is_moe_router(layer) else FP8LinearMethod(None, layer)

    def moe_method(name: str, module) -> FP8ExpertsMethod:
        """MoE experts too: each loaded expert quantized per output row after loading (moe.py)."""
        return FP8ExpertsMethod(FP8Config(None, False, "weight_scale", False), name, in_situ=True)

    def embedding_method(name: str, table: nn.Module) -> FP8HeadMethod | None:
        if head != "fp8" or not isinstance(table, ParallelLMHead):   # embeddings (a head tied to one) stay float
            return None
        logger.info("isq: LM head '%s' quantized to FP8 (%s=fp8)", name, LM_HEAD_ENV)
        return FP8HeadMethod(name)

    method_for.moe_method = moe_method
    method_for.embedding_method = embedding_method
    return method_for
