"""GGUF files are read by a bounds-checked scan of the header that decodes the metadata itself.

Small files are written with gguf's GGUFWriter, then corrupted byte by byte; byte positions come from
gguf's own GGUFReader (field offsets), not from the code under test. Every malformed file must give a
CheckpointError naming the file and the problem, quickly and without a large allocation.
"""

from __future__ import annotations

import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest
import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.reader import GGUFFile, open_gguf_files

TOKENS = ["<s>", "</s>", "a", "b", "c"]


@pytest.fixture
def small_gguf(tmp_path, make_rows):
    """A valid file: metadata (a string array, scalars) and three tensors of three types."""
    path = tmp_path / "small.gguf"
    tensors = {
        "a.weight": (GGMLType.F32, torch.randn(4, 32, generator=torch.Generator().manual_seed(0))),
        "b.weight": (GGMLType.Q8_0, make_rows(GGMLType.Q8_0, 8, 64, seed=1)),
        "c.weight": (GGMLType.Q4_K, make_rows(GGMLType.Q4_K, 2, 256, seed=2)),
    }
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", "small")
    writer.add_uint32("llama.block_count", 1)
    writer.add_array("tokenizer.ggml.tokens", TOKENS)
    for name, (qtype, data) in tensors.items():
        if qtype == GGMLType.F32:
            writer.add_tensor(name, data.numpy())
        else:
            writer.add_tensor(name, data.numpy(), raw_dtype=gguf.GGMLQuantizationType(int(qtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, tensors


def positions(path) -> dict[str, int]:
    """Byte offsets of header fields, found by gguf's own reader."""
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    key_len = len("tokenizer.ggml.tokens")
    pos = {"tokens_count": tokens.offset + 8 + key_len + 4 + 4, "data_start": reader.data_offset}
    for tensor in reader.tensors:
        info = tensor.field.offset + 8 + len(tensor.name) + 4
        n_dims = len(tensor.shape)
        pos[f"{tensor.name}.dims"] = info
        pos[f"{tensor.name}.type"] = info + 8 * n_dims
        pos[f"{tensor.name}.offset"] = info + 8 * n_dims + 4
        pos[f"{tensor.name}.data"] = tensor.data_offset
    return pos


def test_metadata_equals_what_gguf_reads(small_gguf, demo_gguf):
    """Every value, of every type the demo model and the small file hold, as gguf's own reader decodes it."""
    for path in (small_gguf[0], demo_gguf):
        theirs = {name: field.contents() for name, field in gguf.GGUFReader(path).fields.items()
                  if not name.startswith("GGUF.")}   # its pseudo-fields for the header counts
        assert GGUFFile(path).metadata == theirs


def corrupt(path, at: int, value: bytes, out=None):
    data = bytearray(path.read_bytes())
    data[at:at + len(value)] = value
    out = out or path.with_name("corrupt.gguf")
    out.write_bytes(bytes(data))
    return out


def open_fails(path, *patterns: str) -> str:
    """Opening must raise a CheckpointError that names the file and says each pattern; fast and small."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CheckpointError) as info:
            GGUFFile(path)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    message = str(info.value)
    assert str(path) in message
    for pattern in patterns:
        assert pattern in message, message
    assert time.perf_counter() - started < 2.0
    assert peak < 16 << 20, f"opening a malformed file allocated {peak} bytes"
    return message


def test_reads_metadata_and_tensors_in_pytorch_order(small_gguf):
    path, tensors = small_gguf
    file = GGUFFile(path)
    assert file.value("general.name") == "small"
    assert file.value("llama.block_count") == 1
    assert file.value("tokenizer.ggml.tokens") == TOKENS
    assert file.array_length("tokenizer.ggml.tokens") == len(TOKENS)
    assert file.value("missing", "default") == "default"
    by_name = {t.name: t for t in file.tensors}
    assert sorted(by_name) == sorted(tensors)
    for name, (qtype, data) in tensors.items():
        info = by_name[name]
        assert info.qtype == qtype
        rows = data.view(torch.uint8).reshape(data.shape[0], -1)  # the bytes written, row by row
        assert info.shape == ((data.shape[0], 32) if qtype == GGMLType.F32 else
                              (data.shape[0], rows.shape[1] // {GGMLType.Q8_0: 34, GGMLType.Q4_K: 144}[qtype]
                               * {GGMLType.Q8_0: 32, GGMLType.Q4_K: 256}[qtype]))
        assert torch.equal(file.raw(info), rows)
    assert [f.path for f in open_gguf_files(path)] == [path]


def test_read_copies_only_the_rows_and_bytes_asked_for(small_gguf):
    """What a tensor-parallel rank reads (lazy_weights.py): a range or a list of rows, a range of bytes in each."""
    path, _ = small_gguf
    file = GGUFFile(path)
    info = next(t for t in file.tensors if t.name == "b.weight")   # Q8_0 [8, 64]: 2 blocks of 34 bytes a row
    whole = file.raw(info)
    part = file.read(info, slice(2, 5), slice(34, 68))
    assert torch.equal(part, whole[2:5, 34:68]) and part.is_contiguous()
    assert torch.equal(file.read(info, np.array([6, 1, 3]), slice(0, 34)), whole[[6, 1, 3], :34])
    part[:] = 0   # a copy, never the read-only mapping
    assert torch.equal(file.raw(info), whole)


def test_bad_magic_and_version(small_gguf):
    path, _ = small_gguf
    open_fails(corrupt(path, 0, b"GGUX"), "not a GGUF file", "b'GGUX'")
    open_fails(corrupt(path, 4, struct.pack("<I", 7)), "GGUF version 7 is not supported")
    open_fails(corrupt(path, 4, struct.pack(">I", 3)), "big-endian")


def test_empty_and_tiny_files(tmp_path):
    for size in (0, 3, 7):
        path = tmp_path / f"tiny{size}.gguf"
        path.write_bytes(b"GGUF\x03\x00\x00"[:size])
        open_fails(path, "truncated")


def test_every_truncation_of_the_header_is_a_clear_error(small_gguf, tmp_path):
    path, _ = small_gguf
    data = path.read_bytes()
    header_end = positions(path)["data_start"]
    for cut in range(8, header_end + 1):
        truncated = tmp_path / "cut.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"truncated|more than the file can hold|past the end"):
            GGUFFile(truncated)


def test_truncated_tensor_data(small_gguf, tmp_path):
    path, _ = small_gguf
    data = path.read_bytes()
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(data[:-100])
    open_fails(truncated, "tensor 'c.weight'", "runs past the end of the file")


def test_unknown_and_unsupported_tensor_types(small_gguf):
    path, _ = small_gguf
    at = positions(path)["b.weight.type"]
    open_fails(corrupt(path, at, struct.pack("<I", 99)), "GGML type 99", "'b.weight'")
    # a type gguf knows but cvllm does not read
    message = open_fails(corrupt(path, at, struct.pack("<I", int(gguf.GGMLQuantizationType.IQ2_XXS))),
                         "IQ2_XXS", "'b.weight'")
    assert "Q4_K" in message  # lists what is supported


def test_tensor_past_the_end_of_the_file(small_gguf):
    path, _ = small_gguf
    at = positions(path)["a.weight.offset"]
    size = path.stat().st_size
    open_fails(corrupt(path, at, struct.pack("<Q", size // 32 * 32)), "'a.weight'", "past the end of the file")
    open_fails(corrupt(path, at, struct.pack("<Q", 3)), "'a.weight'", "not a multiple of the alignment")


@pytest.mark.parametrize("dim", [2**40, 2**63 + 32])
def test_absurd_dimensions(small_gguf, dim):
    path, _ = small_gguf
    at = positions(path)["b.weight.dims"] + 8  # the second dimension: the row count
    open_fails(corrupt(path, at, struct.pack("<Q", dim)), "'b.weight'", "absurd dimensions")


def test_row_length_not_a_whole_number_of_blocks(small_gguf):
    path, _ = small_gguf
    at = positions(path)["c.weight.dims"]
    open_fails(corrupt(path, at, struct.pack("<Q", 250)), "'c.weight'", "Q4_K blocks of 256")


def test_absurd_counts_do_not_loop_or_allocate(small_gguf):
    path, _ = small_gguf
    open_fails(corrupt(path, positions(path)["tokens_count"], struct.pack("<Q", 2**60)),
               "'tokenizer.ggml.tokens' claims 1152921504606846976 items")
    open_fails(corrupt(path, 8, struct.pack("<Q", 2**62)), "claims 4611686018427387904 tensors")
    open_fails(corrupt(path, 16, struct.pack("<Q", 2**50)), "metadata entries")


def test_random_header_corruption_never_crashes(small_gguf):
    """Flipped bytes may still give a readable file, or an error: always a CheckpointError, never a hang."""
    path, _ = small_gguf
    header_end = positions(path)["data_start"]
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    outcomes = {"opened": 0, "error": 0}
    for _ in range(300):
        at = int(rng.integers(4, header_end))
        broken = corrupt(path, at, bytes(rng.integers(0, 256, size=int(rng.integers(1, 9)), dtype=np.uint8)))
        try:
            GGUFFile(broken)
            outcomes["opened"] += 1
        except CheckpointError:
            outcomes["error"] += 1
    assert outcomes["error"] > 50 and sum(outcomes.values()) == 300
    assert time.perf_counter() - started < 60


def test_split_set_names(tmp_path):
    part2 = tmp_path / "model-00002-of-00003.gguf"
    part2.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"part 2 of a split GGUF set; open the first part, "
                                              r"model-00001-of-00003\.gguf"):
        open_gguf_files(part2)
    first = tmp_path / "model-00001-of-00003.gguf"
    first.write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"split GGUF set of 3 files is missing model-00003-of-00003\.gguf"):
        open_gguf_files(first)
