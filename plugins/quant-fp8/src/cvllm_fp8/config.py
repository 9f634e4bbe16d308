"""The two FP8 ``quantization_config`` dialects, read into one ``FP8Config``; anything else is refused by name.

- ``quant_method: "fp8"`` (transformers' FP8 format): ``weight`` float8_e4m3fn [out, in] and either
  ``weight_scale_inv`` float32 [ceil(out / R), ceil(in / C)] with ``weight_block_size: [R, C]`` (DeepSeek-V3/R1,
  Qwen3 FP8), or ``weight_scale`` float32 (one per tensor, AutoFP8); ``activation_scheme`` "static" adds an
  ``input_scale`` per layer.
- ``quant_method: "compressed-tensors"`` (llm-compressor): one config group whose ``weights`` are ``{num_bits: 8,
  type: "float"}`` with ``strategy`` "tensor", "channel" ([out, 1] scales) or "block" (``block_structure``), and
  ``weight_scale``; ``ignore`` lists float modules; static ``input_activations`` add an ``input_scale``.

Either way W = float(weight) * scale of its (row, column) block. Activation scales are read and not used: cvllm
computes with the weights in FP8 and the activations in the engine's dtype (W8A16).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class FP8ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class FP8Config:
    block: tuple[int, int] | None   # (rows, columns) per scale; None: one scale per row ("channel") or tensor
    per_tensor: bool                # one scale per checkpoint tensor (a fused layer's shards each have theirs)
    scale_name: str                 # "weight_scale_inv" or "weight_scale"
    static_input: bool              # the checkpoint has an input_scale per layer (read, not used)
    ignore: tuple[str, ...] = field(default=())


def parse_fp8_config(config: dict[str, Any], where: str) -> FP8Config:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FP8ConfigError(f"{where}: fmt {fmt!r} is not supported (FP8 e4m3 only)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise FP8ConfigError(f"{where}: activation_scheme {scheme!r} is not 'dynamic' or 'static'")
    block = config.get("weight_block_size")
    ignore = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers") or ())
    if block is None:
        return FP8Config(None, True, "weight_scale", scheme == "static", ignore)
    return FP8Config(_block(block, where, "weight_block_size"), False, "weight_scale_inv", scheme == "static", ignore)


def parse_compressed_tensors_config(config: dict[str, Any], where: str) -> FP8Config:
    groups = config.get("config_groups") or {}
    if len(groups) != 1:
        raise FP8ConfigError(f"{where}: {len(groups)} config_groups; FP8 checkpoints with exactly one are supported")
    group = next(iter(groups.values()))
    weights = group.get("weights") or {}
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise FP8ConfigError(f"{where}: weights {{type: {weights.get('type')!r}, num_bits: "
                             f"{weights.get('num_bits')!r}}}: only FP8 weights (type 'float', 8 bits) are supported "
                             f"by cvllm-quant-fp8")
    if weights.get("dynamic"):
        raise FP8ConfigError(f"{where}: dynamic weight scales are not supported")
    strategy = weights.get("strategy", "tensor")
    activations = group.get("input_activations") or {}
    static = bool(activations) and not activations.get("dynamic", True)
    ignore = tuple(config.get("ignore") or ())
    if strategy in ("tensor", "channel"):
        return FP8Config(None, strategy == "tensor", "weight_scale", static, ignore)
    if strategy == "block":
        return FP8Config(_block(weights.get("block_structure"), where, "block_structure"), False, "weight_scale",
                         static, ignore)
    raise FP8ConfigError(f"{where}: weights strategy {strategy!r} is not supported (tensor, channel or block)")


def _block(value: Any, where: str, name: str) -> tuple[int, int]:
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise FP8ConfigError(f"{where}: {name} {value!r} is not [rows, columns]")
    return int(value[0]), int(value[1])
