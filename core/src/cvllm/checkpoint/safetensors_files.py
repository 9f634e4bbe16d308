"""Reading ``*.safetensors`` files with errors that name the file and the problem."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from cvllm.checkpoint.base import CheckpointError

_MAX_HEADER = 100 * 1024 * 1024


def check_safetensors_file(path: Path) -> None:
    """Validate the header against the file size before anything is mapped.

    safetensors would raise too, but with a message that names neither the file nor the tensor;
    a truncated download is the usual cause, so say so.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(_MAX_HEADER, size - 8):
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file (header length {header_len}, file size {size})")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (a JSON {type(header).__name__}, not an object)")
    data_len = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            if not (isinstance(start, int) and isinstance(end, int)):
                raise TypeError
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{path}: tensor '{name}' has no valid data_offsets") from None
        if end > data_len or start > end:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor '{name}' ends at byte {end} of the data "
                f"section, but the file holds only {data_len} bytes of data")


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        check_safetensors_file(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error type; give it a file name
            raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from e
