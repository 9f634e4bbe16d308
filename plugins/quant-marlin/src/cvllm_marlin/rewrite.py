"""A checkpoint directory rewritten shard by shard (the converters' common part: convert.py, awq_to_gptq.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cvllm.checkpoint.hf_dir import weight_files
from cvllm.progress import Progress

logger = logging.getLogger(__name__)


def rewrite(src: Path, out: Path, convert, what: str) -> int:
    """Copies ``src``'s safetensors files into ``out`` shard by shard, each tensor through ``convert(name, tensor,
    open shard)``: the tensors to write in its place (``{}``: none), or None to copy it unchanged; the index follows,
    and the other files (tokenizer, generation config, chat template) are copied. Returns how many it converted."""
    files = weight_files(src)
    if not files or any(f.suffix != ".safetensors" for f in files):
        raise ValueError(f"{src}: conversion reads safetensors weights only")
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.suffix != ".safetensors" and item.name not in ("config.json",
                                                                                  "model.safetensors.index.json"):
            shutil.copy2(item, out / item.name)
    weight_map: dict[str, str] = {}
    converted = 0
    with Progress(logger, what, "converted", "tensors") as progress:
        for file in files:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    written = convert(name, tensor, f)
                    if written is None:
                        tensors[name] = tensor
                    else:
                        tensors.update(written)
                        converted += bool(written)
                    progress.update(nbytes=tensor.numel() * tensor.element_size())
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / file.name), metadata={"format": "pt"})
            weight_map.update({name: file.name for name in tensors})
    if (src / "model.safetensors.index.json").exists():
        index = json.loads((src / "model.safetensors.index.json").read_text())
        index["weight_map"] = weight_map
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return converted


def write_config(out: Path, config: dict, quantization_config: dict) -> None:
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}, indent=2))
