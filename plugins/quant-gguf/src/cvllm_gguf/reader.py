"""Opening GGUF files safely and fast: every length in the header is checked against the file before use.

``scan_header`` reads the header in one pass, metadata values included, with bounds checks: each problem is
a ``CheckpointError`` naming the file and what is wrong, and nothing is allocated from a size the file cannot
back. (The ``gguf`` package's ``GGUFReader`` trusts the header, so a corrupt file could send it through 2**60
empty reads, and it builds a numpy view per array item: 5 s for the demo model's 100k vocabulary strings,
against ~0.1 s here. The tests check this reader against it.)
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm_gguf.quant_types import FORMATS, GGMLType, UnsupportedQuantType, resolve_qtype

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_LENGTH = 1 << 24  # far above any real vocabulary; a longer array is corruption
MAX_ARRAY_NESTING = 2
# GGUFValueType ids: scalar sizes in bytes, then string and array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# the same ids as little-endian numpy dtypes (7 is bool)
_SCALAR_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
                  11: "<i8", 12: "<f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    qtype: GGMLType
    dims: tuple[int, ...]  # GGUF order: dims[0] (ne0) is the innermost, contiguous one
    offset: int  # absolute byte offset of the data in its file
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The PyTorch / Hugging Face shape: GGUF's dims reversed, e.g. [out_features, in_features]."""
        return tuple(reversed(self.dims))

    @property
    def row_bytes(self) -> int:
        fmt = FORMATS[self.qtype]
        return self.dims[0] // fmt.block_size * fmt.type_size


@dataclass(frozen=True, slots=True)
class Header:
    version: int
    kv_count: int
    alignment: int
    data_start: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, Any]  # key -> str, int, float, bool, or a list of them


class _Cursor:
    """Reads little-endian values from the mapped file, refusing to step past its end."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise self.error(f"truncated GGUF file: {what} at byte {self.pos} needs {n} bytes, "
                             f"but the file ends at byte {self.size}")
        start = self.pos
        self.pos += n
        return start

    def remaining(self) -> int:
        return self.size - self.pos

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        length = self.u64(f"length of {what}")
        start = self.take(length, what)
        try:
            return bytes(self.buf[start:start + length]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} at byte {start} is not UTF-8 text") from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        """Read one metadata value: str, int, float, bool, or a (nested) list of them."""
        if vtype in _SCALAR_BYTES:
            start = self.take(_SCALAR_BYTES[vtype], f"value of '{key}'")
            return np.frombuffer(self.buf, _SCALAR_DTYPES[vtype], 1, start).item()
        if vtype == _STRING:
            return self.text(f"value of '{key}'")
        if vtype == _ARRAY and depth < MAX_ARRAY_NESTING:
            item_type = self.u32(f"item type of '{key}'")
            count = self.u64(f"length of '{key}'")
            smallest = _SCALAR_BYTES.get(item_type, 8)  # a string or nested array takes at least 8 bytes
            if count > MAX_ARRAY_LENGTH or count * smallest > self.remaining():
                raise self.error(f"metadata array '{key}' claims {count} items, more than the file can hold")
            if item_type in _SCALAR_BYTES:  # one numpy read for the whole array
                start = self.take(count * smallest, f"value of '{key}'")
                return np.frombuffer(self.buf, _SCALAR_DTYPES[item_type], count, start).tolist()
            if item_type == _STRING:  # the vocabulary: the one loop over items that matters, kept lean
                return [self.text(f"item {i} of '{key}'") for i in range(count)]
            return [self.value(item_type, key, depth + 1) for _ in range(count)]
        raise self.error(f"metadata '{key}' has unknown value type {vtype}")

    def text(self, what: str) -> str:
        """A length-prefixed string value; bytes that are not UTF-8 become U+FFFD, as llama.cpp's tokens may."""
        length = self.u64(f"length of {what}")
        start = self.take(length, what)
        return bytes(self.buf[start:start + length]).decode("utf-8", errors="replace")


def scan_header(path: Path, buf: mmap.mmap | bytes) -> Header:
    cur = _Cursor(buf, path)
    if cur.size < 4 or bytes(buf[:4]) != MAGIC:
        found = bytes(buf[:4])
        raise cur.error(f"not a GGUF file (magic {found!r}, expected {MAGIC!r})")
    cur.take(4, "magic")
    version = cur.u32("version")
    if version not in VERSIONS:
        endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise cur.error(f"GGUF version {version}{endian} is not supported (cvllm reads versions 2 and 3)")
    n_tensors, n_kv = cur.u64("tensor count"), cur.u64("metadata count")
    if n_kv * _MIN_KV_BYTES > cur.remaining():
        raise cur.error(f"header claims {n_kv} metadata entries, more than the file can hold")
    if n_tensors * _MIN_TENSOR_INFO_BYTES > cur.remaining():
        raise cur.error(f"header claims {n_tensors} tensors, more than the file can hold")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key of metadata entry {i}")
        vtype = cur.u32(f"value type of '{key}'")
        if key == "general.alignment" and vtype != _UINT32:
            raise cur.error(f"general.alignment has value type {vtype}, expected uint32")
        metadata[key] = cur.value(vtype, key)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise cur.error(f"general.alignment {alignment} is not a power of two")
    infos = [_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment
    tensors = tuple(_checked_tensor(cur, info, data_start, alignment) for info in infos)
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise cur.error(f"tensor '{duplicate}' appears twice")
    return Header(version, n_kv, alignment, data_start, tensors, metadata)


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string(f"name of tensor {index}")
    n_dims = cur.u32(f"dimension count of tensor '{name}'")
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.error(f"tensor '{name}' has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
    dims = tuple(cur.u64(f"dimensions of tensor '{name}'") for _ in range(n_dims))
    raw_type = cur.u32(f"type of tensor '{name}'")
    offset = cur.u64(f"data offset of tensor '{name}'")
    return name, dims, raw_type, offset


def _checked_tensor(cur: _Cursor, info: tuple[str, tuple[int, ...], int, int], data_start: int,
                    alignment: int) -> TensorInfo:
    name, dims, raw_type, offset = info
    try:
        qtype = resolve_qtype(raw_type, name)
    except UnsupportedQuantType as e:
        raise cur.error(str(e)) from None
    fmt = FORMATS[qtype]
    if dims[0] % fmt.block_size:
        raise cur.error(f"tensor '{name}': rows of {dims[0]} elements do not split into {qtype.name} "
                        f"blocks of {fmt.block_size}")
    nbytes = prod(dims) // fmt.block_size * fmt.type_size  # Python ints: no overflow
    if nbytes > cur.size:
        raise cur.error(f"tensor '{name}' of dimensions {list(dims)} ({qtype.name}) needs {nbytes} bytes, more "
                        f"than the whole file of {cur.size} bytes: absurd dimensions, or a truncated file")
    if offset % alignment:
        raise cur.error(f"tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}")
    start = data_start + offset
    if start + nbytes > cur.size:
        raise cur.error(f"tensor '{name}' ({nbytes} bytes at byte {start}) runs past the end of the file "
                        f"({cur.size} bytes): truncated?")
    return TensorInfo(name, qtype, dims, start, nbytes)


class GGUFFile:
    """One validated GGUF file: its metadata as Python values, its tensors as raw bytes of a read-only mapping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < 8:
                    raise CheckpointError(f"{self.path}: truncated GGUF file ({size} bytes)")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({e})") from None
        self.header = scan_header(self.path, self._map)
        self.metadata = self.header.metadata
        self.tensors = self.header.tensors

    def __reduce__(self):
        """Pickled (for tensor-parallel workers) as its path, size and tensor table: the worker maps the file
        again without scanning its header, and the metadata (the tokenizer's arrays) stays behind."""
        return _remap, (self.path, len(self._map), self.tensors)

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def array_length(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return len(value) if isinstance(value, list) else None

    def raw(self, tensor: TensorInfo) -> torch.Tensor:
        """The tensor's bytes, copied out of the mapping: uint8 [rows, bytes_per_row]."""
        return self.read(tensor)

    def read(self, tensor: TensorInfo, rows: slice | np.ndarray = slice(None),
             columns: slice = slice(None)) -> torch.Tensor:
        """Some of the tensor's bytes, copied out of the mapping: ``rows`` (a range, or row indices in the order
        wanted) and ``columns`` (a range of bytes in each row) of its uint8 [rows, bytes_per_row] layout. Only
        those bytes are read: what a tensor-parallel rank's share of a weight costs (lazy_weights.py)."""
        data = np.frombuffer(self._map, np.uint8, tensor.nbytes, tensor.offset).reshape(-1, tensor.row_bytes)
        part = data[rows, columns]
        # ranges give a view of the read-only mapping, indices a copy already; either way the result is a copy
        return torch.from_numpy(part.copy() if isinstance(rows, slice) else np.ascontiguousarray(part))


def _remap(path: Path, size: int, tensors: tuple[TensorInfo, ...]) -> GGUFFile:
    """An unpickled ``GGUFFile``: the tensors' bytes only (no metadata), after checking the file's size."""
    file = GGUFFile.__new__(GGUFFile)
    file.path, file.header, file.metadata, file.tensors = path, None, {}, tensors
    try:
        with open(path, "rb") as f:
            file._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None
    if len(file._map) != size:
        raise CheckpointError(f"{path}: the file changed since it was opened ({size} bytes, now {len(file._map)})")
    return file


def split_parts(path: Path) -> list[Path]:
    """All files of a split set, given its first (``name-00001-of-00003.gguf``); else just ``path``."""
    match = SPLIT_NAME.match(path.name)
    if match is None:
        return [path]
    number, count = int(match["no"]), int(match["count"])
    width = len(match["count"])
    if number != 1:
        first = f"{match['stem']}-{1:0{width}d}-of-{match['count']}.gguf"
        raise CheckpointError(f"{path}: part {number} of a split GGUF set; open the first part, {first}")
    parts = [path.with_name(f"{match['stem']}-{i:0{width}d}-of-{match['count']}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.exists()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF set of {count} files is missing {', '.join(missing)}")
    return parts


def open_gguf_files(path: str | Path) -> list[GGUFFile]:
    """The file (or every file of its split set), validated; metadata lives in the first."""
    files = [GGUFFile(part) for part in split_parts(Path(path))]
    seen: dict[str, Path] = {}
    for file in files:
        for tensor in file.tensors:
            if tensor.name in seen:
                raise CheckpointError(f"{file.path}: tensor '{tensor.name}' is also in {seen[tensor.name].name}")
            seen[tensor.name] = file.path
    declared = files[0].value("split.tensors.count")
    if declared is not None and declared != len(seen):
        raise CheckpointError(f"{path}: the split set declares {declared} tensors but its files hold {len(seen)}")
    return files
