"""GGML blocks to float32 in torch, vectorised over all blocks at once.

Each decoder reads a ``[n_blocks, type_size]`` uint8 tensor and performs the same float32
operations, in the same order, as the gguf package's numpy reference (``gguf.quants``), so the
results are equal bit for bit: e.g. Q4_1 is ``(d * q) + m`` with two roundings, never a fused
multiply-add, and K-quant sub-block scales are ``d * sc`` before they multiply the quants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import prod

import torch

from cvllm_gguf.quant_types import FLOAT_DTYPES, FORMATS, QK_K, GGMLType, resolve_qtype


def _reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bytes as ``dtype`` (little-endian, as GGUF stores them); copies only when misaligned."""
    raw = raw.contiguous()
    try:
        return raw.view(dtype)
    except RuntimeError:  # a storage offset that is not a multiple of the element size
        return raw.clone().view(dtype)


def _f16_to_f32(half: torch.Tensor) -> torch.Tensor:
    """float16 to float32, keeping NaN payloads as numpy does (torch's conversion makes every NaN
    0x7fffffff): a NaN becomes sign | 0x7f800000 | mantissa << 13."""
    out = half.float()
    nan = torch.isnan(half)
    if bool(nan.any()):
        bits = half.view(torch.int16).int()
        exact = ((bits & -0x8000) << 16) | 0x7F800000 | ((bits & 0x03FF) << 13)
        out = torch.where(nan, exact.view(torch.float32), out)
    return out


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte ``start`` of each block, as float32 [n_blocks, 1]."""
    return _f16_to_f32(_reinterpret(blocks[:, start:start + 2], torch.float16))


def _shifts(*values: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _split_bits(packed: torch.Tensor, group: int, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Unpack fields of ``packed`` [n, bytes] the way ggml lays them out: every ``group`` bytes
    first give all their fields at shift 0, then all at the next shift, and so on.
    Returns uint8 [n, bytes * len(shifts)]."""
    n = packed.shape[0]
    shift = _shifts(*shifts, device=packed.device).view(1, 1, -1, 1)
    fields = packed.view(n, -1, 1, group) >> shift  # [n, groups, len(shifts), group]
    return (fields & mask).reshape(n, -1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Each byte's 8 bits, least significant first, i.e. bit j of a little-endian mask: uint8 [n, bytes * 8]."""
    return _split_bits(packed, 1, range(8), 1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _split_bits(b[:, 2:], 16, (0, 4), 0x0F)
    return d * (q.to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _split_bits(b[:, 4:], 16, (0, 4), 0x0F).float()
    return (d * q) + m


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Q5 quants: low nibbles from ``qs``, bit 4 from the little-endian 32-bit mask ``qh``."""
    return _split_bits(qs, 16, (0, 4), 0x0F) | (_bits(qh) << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    q = _five_bit(b[:, 2:6], b[:, 6:])
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b, 0), _f16(b, 2)
    q = _five_bit(b[:, 4:8], b[:, 8:]).float()
    return (d * q) + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b, 0)
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).view(n, 16, 1)
    q = _split_bits(qs, 32, (0, 2, 4, 6), 3).view(n, 16, 16).float()
    return (dl * q - ml).view(n, QK_K)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, packed_scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    # 16 six-bit scales: low nibbles from bytes 0-7, top two bits from bytes 8-11
    low = _split_bits(packed_scales[:, :8], 8, (0, 4), 0x0F)
    high = _split_bits(packed_scales[:, 8:], 4, (0, 2, 4, 6), 3)
    scales = ((low | (high << 4)).to(torch.int8) - 32).float()
    dl = (d * scales).view(n, 16, 1)
    ql = _split_bits(qs, 32, (0, 2, 4, 6), 3).view(n, 16, 16)
    # a clear hmask bit subtracts 4; a set one subtracts nothing
    qh = _split_bits(hmask, 32, range(8), 1).view(n, 16, 16) ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()
    return (dl * q).view(n, QK_K)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed into 12 bytes."""
    d, m, md = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    minimum = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scale, minimum


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    q = _split_bits(b[:, 16:], 32, (0, 4), 0x0F).view(n, 8, 32).float()
    return (dl * q - ml).view(n, QK_K)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dl = (d * sc.float()).view(n, 8, 1)
    ml = (dmin * mn.float()).view(n, 8, 1)
    ql = _split_bits(b[:, 48:], 32, (0, 4), 0x0F)
    qh = _split_bits(b[:, 16:48], 32, range(8), 1)
    q = (ql | (qh << 4)).view(n, 8, 32).float()
    return (dl * q - ml).view(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    dl = (d * scales.contiguous().view(torch.int8).float()).view(n, 16, 1)
    low = _split_bits(ql, 64, (0, 4), 0x0F)
    high = _split_bits(qh, 32, (0, 2, 4, 6), 3)
    q = ((low | (high << 4)).to(torch.int8) - 32).view(n, 16, 16).float()
    return (dl * q).view(n, QK_K)


_DECODERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
    GGMLType.Q8_0: _q8_0, GGMLType.Q2_K: _q2_k, GGMLType.Q3_K: _q3_k, GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k, GGMLType.Q6_K: _q6_k,
}


def dequantize(raw: torch.Tensor, qtype: int | str, shape: Sequence[int],
               tensor_name: str | None = None) -> torch.Tensor:
    """float32 tensor of ``shape`` from the raw GGUF bytes (uint8, any shape, rows back to back)."""
    qtype = resolve_qtype(qtype, tensor_name)
    fmt = FORMATS[qtype]
    shape = tuple(int(s) for s in shape)
    numel = prod(shape)
    where = f"'{tensor_name}' " if tensor_name else ""
    if raw.dtype != torch.uint8:
        raise TypeError(f"{where}raw {qtype.name} data must be uint8 bytes, got {raw.dtype}")
    if shape and shape[-1] % fmt.block_size:
        raise ValueError(f"{where}row length {shape[-1]} is not a multiple of the {qtype.name} "
                         f"block size {fmt.block_size}")
    expected = numel // fmt.block_size * fmt.type_size
    if raw.numel() != expected:
        raise ValueError(f"{where}{qtype.name} tensor of shape {list(shape)} needs {expected} bytes, "
                         f"got {raw.numel()}")
    if qtype in FLOAT_DTYPES:
        values = _reinterpret(raw.reshape(-1), FLOAT_DTYPES[qtype])
        # F32 is copied too: the result never aliases the caller's byte buffer
        return (values.clone() if qtype == GGMLType.F32
                else _f16_to_f32(values) if qtype == GGMLType.F16 else values.float()).view(shape)
    blocks = raw.reshape(-1, fmt.type_size)
    return _DECODERS[qtype](blocks).view(shape)


def dequantize_stacked(raw: torch.Tensor, qtype: int | str, shape: Sequence[int], dtype: torch.dtype,
                       tensor_name: str | None = None) -> torch.Tensor:
    """A stacked tensor (``shape`` [n, *rest], e.g. one weight per expert) dequantized to ``dtype``
    one slice at a time: the float32 intermediate is one slice, never the whole tensor (a layer of
    128 experts is hundreds of MB in float32)."""
    shape = tuple(int(s) for s in shape)
    if dtype == torch.float32 or len(shape) < 2 or raw.numel() % shape[0]:
        return dequantize(raw, qtype, shape, tensor_name).to(dtype)  # (a wrong size raises there)
    slices = raw.reshape(shape[0], -1)
    out = torch.empty(shape, dtype=dtype)
    for i in range(shape[0]):
        out[i] = dequantize(slices[i], qtype, shape[1:], tensor_name)
    return out
