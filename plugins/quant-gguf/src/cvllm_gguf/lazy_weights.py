"""GGUF tensors as LazyTensors (cvllm/checkpoint/lazy.py): a tensor-parallel rank narrows them to its shard, and
only that shard's bytes are copied out of the file mapping, un-permuted and dequantized.

- ``blocks``: a quantized linear's raw blocks, uint8 [rows, bytes_per_row]. Its layer narrows it on rows
  (column-parallel) or on whole blocks of a row (row-parallel, aligned): either is a slice of the mapping.
- ``stacked_blocks``: a MoE layer's stacked experts kept quantized, uint8 [experts, rows, bytes_per_row].
- ``dequantized``: everything loaded as floats (embeddings, norms, float linears, other stacked experts). A part
  reads its rows and the blocks that cover its columns, and dequantizes only those.

q/k rows that llama.cpp permuted are read in un-permuted order (row indices), so a rank's heads are its own rows
and nothing else. 1-D tensors (norms, biases) are small and read whole, as before.
"""

from __future__ import annotations

import numpy as np
import torch

from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.lazy import Box, LazyTensor
from cvllm_gguf.adapters import unpermute_rows
from cvllm_gguf.dequant import dequantize, dequantize_stacked
from cvllm_gguf.quant_types import FORMATS


def blocks(weight) -> torch.Tensor | LazyTensor:
    """The raw blocks of a ``GGUFWeight`` (checkpoint.py), q/k rows un-permuted."""
    info = weight.info
    if len(info.shape) != 2:
        return _raw_whole(weight)
    order = _row_order(weight)

    def read(box: Box) -> torch.Tensor:
        (row, rows), (byte, nbytes) = box
        return weight.file.read(info, _rows(order, row, rows), slice(byte, byte + nbytes))

    return LazyTensor((info.shape[0], info.row_bytes), torch.uint8, read)


def stacked_blocks(weight) -> LazyTensor:
    """The raw blocks of stacked experts (a 3-D ``GGUFWeight``), uint8 [experts, rows, bytes_per_row]: a part reads
    only its experts' rows (expert parallelism)."""
    info = weight.info
    num_experts, per_expert = weight.shape[0], weight.shape[1]

    def read(box: Box) -> torch.Tensor:
        (expert, experts), (row, rows), (byte, nbytes) = box
        flat = _expert_rows(expert, experts, row, rows, per_expert)
        return weight.file.read(info, flat, slice(byte, byte + nbytes)).view(experts, rows, nbytes)

    return LazyTensor((num_experts, per_expert, info.row_bytes), torch.uint8, read)


def dequantized(weight, dtype: torch.dtype = torch.float32) -> torch.Tensor | LazyTensor:
    """A ``GGUFWeight`` as a ``dtype`` tensor of its Hugging Face shape: 2-D, or 3-D stacked experts (which
    ``dequantize_stacked`` converts one expert at a time, so the float32 intermediate is never the whole stack)."""
    info, shape = weight.info, weight.shape
    if not (len(shape) == len(info.shape) == 2 or len(shape) == len(info.shape) == 3 and weight.permute_heads is None):
        return dequantize(_raw_whole(weight), info.qtype, shape, info.name).to(dtype)   # 1-D: small
    order = _row_order(weight)
    fmt = FORMATS[info.qtype]

    def read(box: Box) -> torch.Tensor:
        *lead, (column, columns) = box
        # the blocks that cover the columns: a row-parallel part dequantizes its own blocks only
        first, last = column // fmt.block_size, -(-(column + columns) // fmt.block_size)
        byte_range, width = slice(first * fmt.type_size, last * fmt.type_size), (last - first) * fmt.block_size
        if len(lead) == 1:
            [(row, rows)] = lead
            raw = weight.file.read(info, _rows(order, row, rows), byte_range)
            values = dequantize(raw, info.qtype, (rows, width), info.name).to(dtype)
        else:   # stacked experts: the file's rows are [experts * rows_per_expert]
            (expert, experts), (row, rows) = lead
            raw = weight.file.read(info, _expert_rows(expert, experts, row, rows, shape[1]), byte_range)
            values = dequantize_stacked(raw, info.qtype, (experts, rows, width), dtype, info.name)
        return values.narrow(-1, column - first * fmt.block_size, columns)

    return LazyTensor(shape, dtype, read)


def _expert_rows(expert: int, experts: int, row: int, rows: int, per_expert: int) -> slice | np.ndarray:
    """The file rows of rows [row, row + rows) of experts [expert, expert + experts): the file holds stacked
    experts as [experts * per_expert] rows."""
    if rows == per_expert:
        return slice(expert * per_expert, (expert + experts) * per_expert)
    return (np.arange(expert, expert + experts)[:, None] * per_expert + np.arange(row, row + rows)).ravel()


def _raw_whole(weight) -> torch.Tensor:
    """All the bytes, rows un-permuted (a 1-D bias: one row per element)."""
    raw = weight.file.raw(weight.info)
    if weight.permute_heads is None:
        return raw
    return _unpermute(weight, raw.view(weight.info.shape[0], -1)).view(raw.shape)


def _row_order(weight) -> np.ndarray | None:
    """For permuted q/k rows, the file row of each un-permuted row; None when the rows are in order."""
    if weight.permute_heads is None:
        return None
    return _unpermute(weight, torch.arange(weight.info.shape[0])).numpy()


def _unpermute(weight, rows: torch.Tensor) -> torch.Tensor:
    try:
        return unpermute_rows(rows, weight.permute_heads)
    except ValueError as e:
        raise CheckpointError(f"{weight.file.path}: tensor '{weight.info.name}': {e}") from None


def _rows(order: np.ndarray | None, start: int, count: int) -> slice | np.ndarray:
    return slice(start, start + count) if order is None else order[start:start + count]
