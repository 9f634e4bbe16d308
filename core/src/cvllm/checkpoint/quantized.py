"""What quantizer plugins read of a checkpoint besides its tensors: the ``quantization_config`` and the safetensors
headers (which modules hold which tensors, in which dtype), without loading anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cvllm.checkpoint.base import Checkpoint, CheckpointError


def quantization_config(checkpoint: Checkpoint) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` dict: ``quant_config`` when a reader set one, else config.json's."""
    config = checkpoint.quant_config if isinstance(checkpoint.quant_config, dict) else \
        checkpoint.config.get("quantization_config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{checkpoint.path}: quant_method {checkpoint.quant_method!r} but config.json has no "
                              f"quantization_config object")
    return config


def tensor_headers(checkpoint: Checkpoint) -> dict[str, dict] | None:
    """Every tensor's safetensors header entry (dtype, shape, offsets) by name; None for a checkpoint that is not a
    directory of safetensors files."""
    path = Path(checkpoint.path)
    if not path.is_dir():
        return None
    from cvllm.checkpoint.hf_dir import weight_files
    from cvllm.checkpoint.safetensors_files import check_safetensors_file

    headers: dict[str, dict] = {}
    for file in weight_files(path):
        headers.update((name, info) for name, info in check_safetensors_file(file).items()
                       if name != "__metadata__")
    return headers
