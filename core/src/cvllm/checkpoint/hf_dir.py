"""The built-in checkpoint reader: a Hugging Face model directory.

config.json, one ``model.safetensors`` or shards listed in ``model.safetensors.index.json`` (or, with no
safetensors, PyTorch ``pytorch_model*.bin`` files: pytorch_bin.py), tokenizer.json + tokenizer_config.json,
generation_config.json. A class serving the language model of a multimodal checkpoint declares where it is
(``nested_text_model``, nested.py): its config is flattened and its tensors renamed here.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from cvllm.checkpoint.base import Checkpoint, CheckpointError
from cvllm.checkpoint.nested import NestedTextModel
from cvllm.checkpoint.pytorch_bin import bin_files, iterate_bins
from cvllm.checkpoint.safetensors_files import check_safetensors_file, iterate_safetensors
from cvllm.checkpoint.sentence_transformers import MODULES_FILE, adapt_base_model, read_declared_pooling
from cvllm.config import load_json, model_config_from_dict

INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: Path) -> list[Path]:
    """The directory's safetensors files, or else its PyTorch ``.bin`` files (pytorch_bin.py)."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = load_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' listing the shards")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: lists shards that are not in {path}: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors")) or bin_files(path)
    if not files:
        raise CheckpointError(f"{path}: no weight files (*.safetensors, or pytorch_model*.bin)")
    return files


def tensor_file(path: Path, files: list[Path], name: str) -> Path | None:
    """Which of the directory's weight ``files`` holds tensor ``name``: the only one, or the index's entry for it
    (None for a name the index lacks: one a reader renamed, a .bin shard)."""
    if len(files) == 1:
        return files[0]
    index = path / INDEX_FILE
    entry = load_json(index, "safetensors index").get("weight_map", {}).get(name) if index.exists() else None
    return path / entry if isinstance(entry, str) else None


def architecture_class(raw: dict) -> object | None:
    """The class registered for the config's architecture (None for an unknown one: building the model says so
    later)."""
    from cvllm import plugins

    names = raw.get("architectures") or []
    registry = plugins.architectures()
    if not names or names[0] not in registry:
        return None
    return registry.get(names[0])


def open_hf_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path}: missing config.json (not a Hugging Face model directory)")
    raw = load_json(config_file, "config.json")
    model_class = architecture_class(raw)
    aliases = dict(getattr(model_class, "config_aliases", None) or {})
    nested: NestedTextModel | None = getattr(model_class, "nested_text_model", None)
    if nested is not None and not nested.holds(raw):
        nested = None
    flat = nested.flat_config(raw) if nested is not None else raw
    config = model_config_from_dict(flat, source=str(config_file), aliases=aliases)
    config.raw_config = dict(raw)
    files = weight_files(path)
    weights = partial(iterate_bins if files[0].suffix == ".bin" else iterate_safetensors, files)
    if nested is not None:  # a multimodal checkpoint served by its language model (nested.py)
        weights = nested.weights(weights)
    pooling = read_declared_pooling(path)
    if (path / MODULES_FILE).exists() and files[0].suffix != ".bin":
        weights = adapt_base_model(config, tensor_names(path, files), weights, path)
    generation_config = {}
    if (path / "generation_config.json").exists():
        generation_config = load_json(path / "generation_config.json", "generation_config.json")
    tokenizer = None
    if (path / "tokenizer.json").exists():
        from cvllm.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(path)
    quant = raw.get("quantization_config") or {}
    return Checkpoint(
        path=path,
        config=config,
        weight_iterator=weights,
        tokenizer=tokenizer,
        generation_config=generation_config,
        quant_method=quant.get("quant_method"),
        format="hf",
        pooling=pooling,
        tensor_file=partial(tensor_file, path, files),
    )


def tensor_names(path: Path, safetensors: list[Path]) -> list[str]:
    """The checkpoint's tensor names, from its index or the files' headers (no tensor is read)."""
    index = path / INDEX_FILE
    if index.exists():
        return list(load_json(index, "safetensors index").get("weight_map") or {})
    return [name for file in safetensors for name in check_safetensors_file(file) if name != "__metadata__"]
