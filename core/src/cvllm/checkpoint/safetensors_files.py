"""Reading ``*.safetensors`` files with errors that name the file and the problem."""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.lazy import LazyTensor, view_reader

_MAX_HEADER = 100 * 1024 * 1024


def check_safetensors_file(path: Path) -> dict:
    """Validate the header against the file size before anything is mapped; returns the header.

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
    return header


# safetensors' dtype names (the format's spec) -> torch
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Each tensor as a view of the file's mapping (no copy here: the weight loader's copy into the parameter,
    on the GPU a host-to-device one, is the only one; safetensors' ``get_tensor`` would copy each tensor out
    first, 16 GB of memcpy for an 8B model), wrapped in a LazyTensor: a tensor-parallel loader narrows it to its
    rank's rows or columns first, so that copy reads only those pages of the file. Tensors of a dtype torch lacks
    go through safetensors itself."""
    for path in files:
        header = check_safetensors_file(path)
        with open(path, "rb") as f:
            # copy-on-write: writable for torch.frombuffer (no warning), though nothing writes; pages come from
            # the page cache as the copies read them
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size else None
        data_start = 8 + struct.unpack("<Q", mapping[:8])[0] if mapping is not None else 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = _DTYPES.get(info.get("dtype")), info.get("shape")
            start, end = info["data_offsets"]
            if dtype is None or not isinstance(shape, list) or end - start != math.prod(shape) * dtype.itemsize:
                yield name, _read_with_safetensors(path, name)
                continue
            if end == start:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            view = torch.frombuffer(mapping, dtype=dtype, count=math.prod(shape), offset=data_start + start)
            yield name, LazyTensor(shape, dtype, view_reader(view.view(shape)))


def _read_with_safetensors(path: Path, name: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)
    except Exception as e:  # safetensors raises its own error type; give it a file name
        raise CheckpointError(f"{path}: cannot read tensor '{name}' ({e})") from e
