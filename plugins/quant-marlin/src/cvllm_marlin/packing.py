"""The packed integer layouts of GPTQ and AWQ checkpoints, unpacked and dequantized with plain torch (CPU or GPU).

Both pack ``32 // bits`` unsigned integers into each int32, the first in the lowest bits.

GPTQ (AutoGPTQ, GPTQModel, optimum, transformers)::

    qweight int32 [in / pack, out]      packed along the INPUT dim: row r holds inputs r*pack .. r*pack+pack-1
    qzeros  int32 [groups, out / pack]  packed along the OUTPUT dim
    scales  fp16  [groups, out]
    g_idx   int32 [in]                  the group of each input feature (i // group_size, or a permutation-derived
                                        map under desc_act / act-order)
    W[i, o] = scales[g_idx[i], o] * (q[i, o] - z[g_idx[i], o])

    The "v1" format (``checkpoint_format`` "gptq", AutoGPTQ's) stores each zero minus one, so z = stored + 1
    (taken modulo 2**bits: a zero of 0 was stored as -1); "gptq_v2" stores z itself.

AWQ, GEMM version (AutoAWQ)::

    qweight int32 [in, out / 8]         packed along the OUTPUT dim, in AWQ's interleaved order: the nibble at
                                        shift 4*k holds column AWQ_PACK_ORDER[k] of the 8 the word covers
    qzeros  int32 [groups, out / 8]     the same interleave
    scales  fp16  [groups, out]
    W[i, o] = scales[i // group_size, o] * (q[i, o] - z[i // group_size, o])

Dequantized weights are returned as float32 [out, in] (``F.linear``'s layout).
"""

from __future__ import annotations

import torch

# nibble k of an AWQ word holds column AWQ_PACK_ORDER[k]; column c sits in nibble AWQ_UNPACK_ORDER[c]
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = tuple(AWQ_PACK_ORDER.index(c) for c in range(8))   # (0, 4, 1, 5, 2, 6, 3, 7)


def _fields(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] int32 words -> [..., n, 32 // bits] unsigned fields, lowest bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def unpack_rows(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight [in / pack, out] -> int32 [in, out]: the fields of a word are consecutive input rows."""
    rows, cols = qweight.shape
    return _fields(qweight, bits).permute(0, 2, 1).reshape(rows * (32 // bits), cols)


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, out / pack] -> int32 [rows, out]: the fields of a word are consecutive output columns
    (GPTQ's qzeros)."""
    rows, cols = packed.shape
    return _fields(packed, bits).reshape(rows, cols * (32 // bits))


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's qweight or qzeros [rows, out / 8] -> int32 [rows, out], the interleave undone."""
    rows, cols = packed.shape
    fields = _fields(packed, 4)                                        # [rows, cols, nibble]
    order = torch.tensor(AWQ_UNPACK_ORDER, device=packed.device)
    return fields.index_select(2, order).reshape(rows, cols * 8)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [in, out] (each in 0 .. 2**bits - 1) -> GPTQ qweight int32 [in / pack, out]. The inverse of unpack_rows."""
    pack = 32 // bits
    rows, cols = values.shape
    fields = (values.to(torch.int64) & ((1 << bits) - 1)).reshape(rows // pack, pack, cols)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64).view(1, pack, 1)
    return _to_int32((fields << shifts).sum(1))


def pack_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int [rows, out] -> int32 [rows, out / pack], consecutive columns per word. The inverse of unpack_columns."""
    pack = 32 // bits
    rows, cols = values.shape
    fields = (values.to(torch.int64) & ((1 << bits) - 1)).reshape(rows, cols // pack, pack)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    return _to_int32((fields << shifts).sum(-1))


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [rows, out] (0 .. 15) -> int32 [rows, out / 8] in AWQ's interleaved order. The inverse of unpack_awq."""
    rows, cols = values.shape
    grouped = values.reshape(rows, cols // 8, 8).index_select(2, torch.tensor(AWQ_PACK_ORDER))
    return pack_columns(grouped.reshape(rows, cols), 4)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int, zero_offset: int = 1, group_offset: int = 0) -> torch.Tensor:
    """float32 [out, in] of a GPTQ layer (or of a column slice of one: qweight, qzeros and scales narrowed to the
    same output columns). ``zero_offset`` is 1 for the v1 format; ``group_offset`` is subtracted from g_idx (a
    row-parallel shard that holds the groups from ``group_offset`` on)."""
    q = unpack_rows(qweight, bits)
    z = (unpack_columns(qzeros, bits) + zero_offset) & ((1 << bits) - 1)
    groups = g_idx.to(torch.long) - group_offset
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= scales.shape[0]):
        raise ValueError(f"g_idx names groups {int(groups.min()) + group_offset}..{int(groups.max()) + group_offset}"
                         f" but this layer holds groups {group_offset}..{group_offset + scales.shape[0] - 1}")
    if q.shape[0] != groups.numel():
        raise ValueError(f"qweight unpacks to {q.shape[0]} input rows but g_idx has {groups.numel()}")
    weight = (q - z[groups]).to(torch.float32) * scales.to(torch.float32)[groups]
    return weight.t().contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """float32 [out, in] of an AWQ (GEMM) layer, or of a shard of one that starts on a group boundary;
    ``group_size`` -1: one group."""
    q = unpack_awq(qweight)
    z = unpack_awq(qzeros)
    rows = q.shape[0]
    groups = torch.zeros(rows, dtype=torch.long, device=q.device) if group_size == -1 else \
        torch.arange(rows, device=q.device) // group_size
    if rows and int(groups.max()) >= scales.shape[0]:
        raise ValueError(f"{rows} input rows in groups of {group_size} need {int(groups.max()) + 1} groups of "
                         f"scales, the layer has {scales.shape[0]}")
    weight = (q - z[groups]).to(torch.float32) * scales.to(torch.float32)[groups]
    return weight.t().contiguous()
