"""Q4_0/Q4_1 blocks repacked for torch's int4-packed CPU matmul (``aten._weight_int4pack_mm_for_cpu``).

The op stores 4-bit values q in 0..15 and, per group of 32 input features and output row, a
(scale, zero) pair; it computes ``w = (q - 8) * scale + zero`` (checked in the tests). A GGML
block is one such group with the same q:

- Q4_0: ``w = d * (q - 8)``       → scale = d, zero = 0
- Q4_1: ``w = d * q + m = d * (q - 8) + (m + 8 d)``  → scale = d, zero = m + 8 d

The pair is stored in the activation dtype (bf16), so d and m + 8 d are rounded to bf16 once.
"""

from __future__ import annotations

import torch

from cvllm_gguf.quant_types import FORMATS, GGMLType

INT4PACK_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1)
GROUP_SIZE = 32  # one GGML block per group
COMPUTE_DTYPE = torch.bfloat16


def packable(out_features: int) -> bool:
    """The op packs output rows in tiles of 16."""
    return out_features % 16 == 0


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start:start + 2].contiguous().view(torch.float16).float().squeeze(-1)


def pack_q4_for_int4mm(qweight: torch.Tensor, qtype: GGMLType, in_features: int,
                       dtype: torch.dtype = COMPUTE_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight, scales_and_zeros [in/32, out, 2]) from raw Q4_0/Q4_1 rows [out, bytes_per_row]."""
    fmt = FORMATS[qtype]
    out_features = qweight.shape[0]
    blocks = qweight.reshape(out_features, in_features // GROUP_SIZE, fmt.type_size)  # [N, G, bytes]
    d = _f16(blocks, 0)  # [N, G]
    quant_start = 2 if qtype == GGMLType.Q4_0 else 4
    nibbles = blocks[..., quant_start:]  # element j: low nibble of byte j; element j + 16: high nibble
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(out_features, in_features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    zero = torch.zeros_like(d) if qtype == GGMLType.Q4_0 else _f16(blocks, 2) + 8 * d
    scales_zeros = torch.stack([d, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [G, N, 2]
    return packed, scales_zeros


_int4pack_mm = torch.ops.aten._weight_int4pack_mm_for_cpu


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w.T in the dtype of ``scales_zeros``; returns [..., out] in that dtype."""
    if x.dim() == 2 and x.dtype == scales_zeros.dtype and x.is_contiguous():
        return _int4pack_mm(x, packed, GROUP_SIZE, scales_zeros)  # the decode path: no reshapes, no casts
    flat = x.reshape(-1, x.shape[-1]).to(scales_zeros.dtype).contiguous()
    out = _int4pack_mm(flat, packed, GROUP_SIZE, scales_zeros)
    return out.view(*x.shape[:-1], out.shape[-1])
