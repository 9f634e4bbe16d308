"""GGUF blocks to the CUDA backend's low-bit plane layout (cvllm_cuda/quant_planes.py), losslessly.

Each type's integers become unsigned (Q8_0's int8 plus 128, Q3_K's two bits plus four times its high bit) and its
own formula is written as ``q * D*A + M*B``:

    Q8_0  d * (q - 128)            Q4_0  d * (q - 8)            Q5_0  d * (q - 16)
    Q4_1  d * q + m                Q5_1  d * q + m
    Q4_K  d*sc * q - dmin*mn       Q5_K  the same, 5 bits        (sc, mn per 32)
    Q6_K  d*sc * (q - 32)          Q3_K  d*(sc - 32) * (q - 4)  Q2_K  d*(sc & 15) * q - dmin*(sc >> 4)   (per 16)

The plane bytes equal the file's but for the K-quants' scales, which are stored one byte each (Q4_K: 148 bytes
per 256 elements instead of 144, Q2_K 100 instead of 84).
"""

from __future__ import annotations

import torch

from cvllm_cuda.quant_planes import QuantLayout, QuantWeight, pack_plane
from cvllm_gguf.dequant import _bits, _f16, _k_scale_min, _split_bits
from cvllm_gguf.quant_types import FORMATS, QK_K, GGMLType

# int8_activations: the batch-1 GEMV rounds x to int8 per 32 inputs as llama.cpp's CUDA backend does (where the
# kernel has that path: layouts without a high plane)
LAYOUTS: dict[GGMLType, QuantLayout] = {
    GGMLType.Q8_0: QuantLayout(8, 0, 32, 32, b_const=-128, int8_activations=True),
    GGMLType.Q4_0: QuantLayout(4, 0, 32, 32, b_const=-8, int8_activations=True),
    GGMLType.Q4_1: QuantLayout(4, 0, 32, 32, has_m=True, int8_activations=True),
    GGMLType.Q5_0: QuantLayout(4, 1, 32, 32, b_const=-16, int8_activations=True),
    GGMLType.Q5_1: QuantLayout(4, 1, 32, 32, has_m=True, int8_activations=True),
    GGMLType.Q2_K: QuantLayout(2, 0, 16, QK_K, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True),
    GGMLType.Q3_K: QuantLayout(2, 1, 16, QK_K, a_mode=1, b_mode=1, b_const=-4, int8_activations=True),
    GGMLType.Q4_K: QuantLayout(4, 0, 32, QK_K, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True),
    GGMLType.Q5_K: QuantLayout(4, 1, 32, QK_K, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True),
    GGMLType.Q6_K: QuantLayout(4, 2, 16, QK_K, a_mode=1, b_mode=1, b_const=-32, int8_activations=True),
}


def _f16_field(blocks: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    return _f16(blocks, start).to(torch.float16).view(rows, -1).t().contiguous()


def _parts(blocks: torch.Tensor, qtype: GGMLType) -> tuple:
    """(q [n_blocks, block elements] unsigned, d, m, a, b) of [n_blocks, type_size] blocks; m, a, b None where the
    layout has none, a and b [n_blocks, scale groups]."""
    b = blocks
    if qtype == GGMLType.Q8_0:
        return b[:, 2:] ^ 0x80, 0, None, None, None
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1):
        at = 2 if qtype == GGMLType.Q4_0 else 4
        return _split_bits(b[:, at:], 16, (0, 4), 0x0F), 0, 2 if at == 4 else None, None, None
    if qtype in (GGMLType.Q5_0, GGMLType.Q5_1):
        at = 2 if qtype == GGMLType.Q5_0 else 4
        q = _split_bits(b[:, at + 4:], 16, (0, 4), 0x0F) | (_bits(b[:, at:at + 4]) << 4)
        return q, 0, 2 if at == 4 else None, None, None
    if qtype == GGMLType.Q2_K:
        scales = b[:, :16]
        return _split_bits(b[:, 16:80], 32, (0, 2, 4, 6), 3), 80, 82, scales & 0x0F, scales >> 4
    if qtype == GGMLType.Q3_K:
        packed = b[:, 96:108]
        low = _split_bits(packed[:, :8], 8, (0, 4), 0x0F)
        high = _split_bits(packed[:, 8:], 4, (0, 2, 4, 6), 3)
        sc = ((low | (high << 4)).to(torch.int8) - 32)
        q = _split_bits(b[:, 32:96], 32, (0, 2, 4, 6), 3) | (_split_bits(b[:, :32], 32, range(8), 1) << 2)
        return q, 108, None, sc, None
    if qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mn = _k_scale_min(b[:, 4:16])
        if qtype == GGMLType.Q4_K:
            q = _split_bits(b[:, 16:], 32, (0, 4), 0x0F)
        else:
            q = _split_bits(b[:, 48:], 32, (0, 4), 0x0F) | (_split_bits(b[:, 16:48], 32, range(8), 1) << 4)
        return q, 0, 2, sc, mn
    if qtype == GGMLType.Q6_K:
        q = _split_bits(b[:, :128], 64, (0, 4), 0x0F) | (_split_bits(b[:, 128:192], 32, (0, 2, 4, 6), 3) << 4)
        return q, 208, None, b[:, 192:208].contiguous().view(torch.int8), None
    raise NotImplementedError(f"no plane layout for {qtype.name}")


def has_layout(qtype: GGMLType) -> bool:
    return qtype in LAYOUTS


# rows repacked at a time: the unpacked integers are int64 for a moment (8 bytes an element), so an LM head is done
# in slices rather than with gigabytes of temporaries
_CHUNK_ELEMENTS = 1 << 24


def to_planes(qweight: torch.Tensor, qtype: GGMLType, in_features: int) -> QuantWeight:
    """The [N, row_bytes] uint8 blocks of an [N, in_features] weight as a ``QuantWeight`` on the same device."""
    rows = max(1, _CHUNK_ELEMENTS // in_features)
    if qweight.shape[0] <= rows:
        return _to_planes(qweight, qtype, in_features)
    parts = [_to_planes(qweight[i:i + rows], qtype, in_features) for i in range(0, qweight.shape[0], rows)]
    first = parts[0]
    joined = {name: torch.cat([getattr(p, name) for p in parts], dim=1) for name in first.tensors()}
    return QuantWeight(first.layout, qweight.shape[0], in_features, **{
        name: joined.get(name) for name in ("low", "high", "d", "m", "a", "b")})


def _to_planes(qweight: torch.Tensor, qtype: GGMLType, in_features: int) -> QuantWeight:
    layout = LAYOUTS[qtype]
    fmt = FORMATS[qtype]
    n = qweight.shape[0]
    blocks = qweight.reshape(-1, fmt.type_size)
    q, d_at, m_at, a, b = _parts(blocks, qtype)
    q = q.reshape(n, in_features)
    low_mask = (1 << layout.low_bits) - 1
    high = pack_plane(q >> layout.low_bits, layout.high_bits) if layout.high_bits else None
    return QuantWeight(
        layout, n, in_features,
        low=pack_plane(q & low_mask, layout.low_bits),
        high=high,
        d=_f16_field(blocks, d_at, n),
        m=_f16_field(blocks, m_at, n) if m_at is not None else None,
        a=a.reshape(n, -1).t().contiguous() if a is not None else None,
        b=b.reshape(n, -1).t().contiguous() if b is not None else None,
    )
