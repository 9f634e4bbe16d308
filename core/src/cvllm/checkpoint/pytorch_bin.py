"""PyTorch ``.bin`` weight files, for model directories that have no safetensors (older hub checkpoints).

They are pickles: loaded with ``torch.load(weights_only=True)``, which unpickles tensors and plain containers only
and refuses anything that would run code, and memory-mapped where the file allows it (``mmap=True``: the zip
format torch.save has written since 1.6), so a tensor's pages are read when the weight loader copies it.
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm.config import load_json

INDEX_FILE = "pytorch_model.bin.index.json"


def bin_files(path: Path) -> list[Path]:
    """The directory's ``.bin`` weight files: the shards its index lists, or ``pytorch_model*.bin`` (not other
    ``.bin`` files a training run leaves, e.g. training_args.bin). Empty when there are none."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = load_json(index, "PyTorch weights index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' listing the shards")
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: lists shards that are not in {path}: {', '.join(missing)}")
        return files
    return sorted(path.glob("pytorch_model*.bin"))


def iterate_bins(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        state = _load(path)
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise CheckpointError(f"{path}: not a PyTorch state dict of tensors")
        yield from state.items()
        del state


def _load(path: Path) -> object:
    try:
        mmap = zipfile.is_zipfile(path)   # the legacy (pre-1.6) format cannot be mapped: read whole
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # weights_only refuses objects that would run code when unpickled
        raise CheckpointError(f"{path}: refused: not plain tensors ({str(e).splitlines()[0]})") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: truncated or not a PyTorch weights file ({e})") from None
