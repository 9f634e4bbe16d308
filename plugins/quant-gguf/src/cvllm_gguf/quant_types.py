"""The GGML tensor types cvllm reads: block size in elements and bytes per block.

The ids are GGML's (``enum ggml_type``, also ``gguf.GGMLQuantizationType``), so a type read from a
GGUF file resolves directly. A GGML type outside this list is an error that names the type and,
when known, the tensor, rather than garbage weights later.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

QK_K = 256  # elements per K-quant super-block


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


@dataclass(frozen=True, slots=True)
class BlockFormat:
    block_size: int  # elements per block
    type_size: int  # bytes per block


FORMATS: dict[GGMLType, BlockFormat] = {
    GGMLType.F32: BlockFormat(1, 4),
    GGMLType.F16: BlockFormat(1, 2),
    GGMLType.BF16: BlockFormat(1, 2),
    GGMLType.Q4_0: BlockFormat(32, 2 + 16),  # f16 d, 32 x 4-bit
    GGMLType.Q4_1: BlockFormat(32, 2 + 2 + 16),  # f16 d, f16 m, 32 x 4-bit
    GGMLType.Q5_0: BlockFormat(32, 2 + 4 + 16),  # f16 d, 32 high bits, 32 x 4-bit
    GGMLType.Q5_1: BlockFormat(32, 2 + 2 + 4 + 16),
    GGMLType.Q8_0: BlockFormat(32, 2 + 32),  # f16 d, 32 x int8
    GGMLType.Q2_K: BlockFormat(QK_K, QK_K // 16 + QK_K // 4 + 2 + 2),
    GGMLType.Q3_K: BlockFormat(QK_K, QK_K // 8 + QK_K // 4 + 12 + 2),
    GGMLType.Q4_K: BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 2),
    GGMLType.Q5_K: BlockFormat(QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    GGMLType.Q6_K: BlockFormat(QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}

# the unquantized types are stored as plain little-endian floats
FLOAT_DTYPES: dict[GGMLType, torch.dtype] = {
    GGMLType.F32: torch.float32,
    GGMLType.F16: torch.float16,
    GGMLType.BF16: torch.bfloat16,
}

# "q4k" (the --isq spelling) and "Q4_K" both name GGMLType.Q4_K
_BY_NAME = {t.name.lower().replace("_", ""): t for t in GGMLType}


class UnsupportedQuantType(ValueError):
    pass


def _describe(qtype: object) -> str:
    """GGML's name for a type id when the gguf package knows it (e.g. IQ2_XXS), else the raw value."""
    if isinstance(qtype, int) and not isinstance(qtype, GGMLType):
        try:
            from gguf import GGMLQuantizationType

            return f"{GGMLQuantizationType(int(qtype)).name} (GGML type {int(qtype)})"
        except (ImportError, ValueError):
            return f"GGML type {int(qtype)}"
    return repr(qtype) if isinstance(qtype, str) else str(qtype)


def resolve_qtype(qtype: int | str, tensor_name: str | None = None) -> GGMLType:
    """A GGML type from its id (an int or ``gguf.GGMLQuantizationType``) or its name ("Q4_K", "q4k")."""
    try:
        if isinstance(qtype, str):
            return _BY_NAME[qtype.lower().replace("_", "")]
        return GGMLType(int(qtype))
    except (KeyError, ValueError, TypeError):
        where = f" in tensor '{tensor_name}'" if tensor_name else ""
        supported = ", ".join(t.name for t in GGMLType)
        raise UnsupportedQuantType(f"unsupported GGML tensor type {_describe(qtype)}{where}; "
                                   f"cvllm-gguf reads {supported}") from None


def block_format(qtype: int | str, tensor_name: str | None = None) -> BlockFormat:
    return FORMATS[resolve_qtype(qtype, tensor_name)]


def row_bytes(qtype: int | str, row_elements: int, tensor_name: str | None = None) -> int:
    """Bytes of one row of ``row_elements`` values; rows must hold whole blocks."""
    qtype = resolve_qtype(qtype, tensor_name)
    fmt = FORMATS[qtype]
    if row_elements % fmt.block_size:
        where = f"'{tensor_name}': " if tensor_name else ""
        raise ValueError(f"{where}rows of {row_elements} elements do not split into {qtype.name} blocks "
                         f"of {fmt.block_size}")
    return row_elements // fmt.block_size * fmt.type_size
