"""float32 to GGML blocks in torch, byte for byte what ``gguf.quants.quantize`` writes.

The legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) follow the numpy reference step by step: the same
float32 operations in the same order (``trunc(x * id + 8.5)``, not ``round``; Q8_0 rounds half
away from zero), scales rounded to f16 only after the quants are computed from the f32 scale.
Inputs must be finite. The K types (Q2_K..Q6_K) are encoded by ``kquants``, byte for byte what
llama.cpp's ``ggml_quantize_chunk`` writes without an importance matrix.
"""

from __future__ import annotations

import torch

from cvllm_gguf.kquants import ENCODERS as K_ENCODERS
from cvllm_gguf.kquants import quantize_k
from cvllm_gguf.quant_types import FLOAT_DTYPES, FORMATS, GGMLType, resolve_qtype


def _f16_bytes(values: torch.Tensor) -> torch.Tensor:
    """[n, 1] float32 → [n, 2] uint8: the f16 scale as stored in a block (little-endian)."""
    return values.to(torch.float16).view(torch.uint8)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 for an all-zero block (whose quants then sit at the zero point)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude in each block, sign kept; the first one on ties (numpy's argmax)."""
    return blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] quants → [n, 16] bytes: element j in the low nibble of byte j, element j + 16 in the high."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """[n, 32] five-bit quants → [n, 4] bytes: bit 4 of element j is bit j of a little-endian uint32."""
    bits = (q >> 4).view(q.shape[0], 4, 8).to(torch.int32)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _trunc_u8(values: torch.Tensor, top: int) -> torch.Tensor:
    return torch.trunc(values).to(torch.uint8).clamp_(0, top)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(b) / -8
    q = _trunc_u8(b * _inverse(d) + 8.5, 15)
    return torch.cat([_f16_bytes(d), _pack_nibbles(q)], dim=-1)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    high, low = b.amax(dim=-1, keepdim=True), b.amin(dim=-1, keepdim=True)
    d = (high - low) / 15
    q = _trunc_u8((b - low) * _inverse(d) + 0.5, 15)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_nibbles(q)], dim=-1)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(b) / -16
    q = _trunc_u8(b * _inverse(d) + 16.5, 31)
    return torch.cat([_f16_bytes(d), _pack_high_bits(q), _pack_nibbles(q)], dim=-1)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    high, low = b.amax(dim=-1, keepdim=True), b.amin(dim=-1, keepdim=True)
    d = (high - low) / 31
    q = _trunc_u8((b - low) * _inverse(d) + 0.5, 31)
    return torch.cat([_f16_bytes(d), _f16_bytes(low), _pack_high_bits(q), _pack_nibbles(q)], dim=-1)


def _round_half_away(values: torch.Tensor) -> torch.Tensor:
    """roundf(): halves away from zero (torch.round rounds them to even)."""
    magnitude = values.abs()
    whole = torch.floor(magnitude)
    return torch.sign(values) * (whole + torch.floor(2 * (magnitude - whole)))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_half_away(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), q], dim=-1)


_ENCODERS = {GGMLType.Q4_0: _q4_0, GGMLType.Q4_1: _q4_1, GGMLType.Q5_0: _q5_0, GGMLType.Q5_1: _q5_1,
             GGMLType.Q8_0: _q8_0}


def quantize(x: torch.Tensor, qtype: int | str) -> torch.Tensor:
    """uint8 [*x.shape[:-1], bytes_per_row]: the rows of ``x`` as GGML blocks of ``qtype``."""
    qtype = resolve_qtype(qtype)
    fmt = FORMATS[qtype]
    if x.dim() == 0 or x.shape[-1] % fmt.block_size:
        row = x.shape[-1] if x.dim() else 0
        raise ValueError(f"cannot quantize shape {list(x.shape)} to {qtype.name}: rows must be a multiple of "
                         f"{fmt.block_size} elements (row length {row})")
    byte_shape = (*x.shape[:-1], x.shape[-1] // fmt.block_size * fmt.type_size)
    if qtype in FLOAT_DTYPES:
        return x.to(FLOAT_DTYPES[qtype]).contiguous().view(torch.uint8).reshape(byte_shape)
    blocks = x.detach().to(torch.float32).reshape(-1, fmt.block_size)
    if qtype.name in K_ENCODERS:
        return quantize_k(blocks, qtype.name).reshape(byte_shape)
    encoder = _ENCODERS.get(qtype)
    if encoder is None:
        raise NotImplementedError(f"quantizing to {qtype.name} is not implemented yet")
    return encoder(blocks).reshape(byte_shape)
