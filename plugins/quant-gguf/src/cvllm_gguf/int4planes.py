"""GGUF blocks as one or two int4 planes for torch's int4-packed CPU matmul (``aten._weight_int4pack_mm_for_cpu``,
the op the Q4 linears use, int4pack.py): how the CPU reads a quantized token embedding as its LM head.

Every legacy type and Q4_K/Q5_K is, per group of 32 inputs, ``w = a * q + b`` with unsigned integers q
(Q8_0: its int8 plus 128, b = -128 a). The op computes ``(p - 8) * scale + zero`` from 4-bit p, so:

- q < 16 (Q4_0, Q4_1, Q4_K): one plane, p = q, scale a, zero 8 a + b;
- q < 256 (Q8_0, Q5_*): two planes of N rows each, stacked into one [2N, K] weight, summed after one matmul:
  high p = (q >> 4) + c with scale 16 a and zero 0, low p = q & 15 with scale a and zero b + 8 a - 16 a (c - 8)
  (c = 0 for Q8_0, whose low zero is then 8 a; c = 8 for Q5's one high bit). Zeros that cancel a large offset
  would lose the values to their bf16 rounding: these are multiples of a by powers of two where the type allows.

The matmul is core's C kernel over these planes (cvllm.backends.cpu_int4mm) where it is built: float32 activations
and sums, a and b kept in float32 (exact: f16 values and their multiples by powers of two) and applied per group
after the group's integer-weighted sum, the planes added in float32, the logits returned in float32. Its error is
then float32 summation's, where torch's int4 op (the fallback, without a C compiler) rounds a and b to bf16 per
group and each plane's output to bf16: on the demo model's Q8_0 table that put the logits further from the exact
ones than a bf16 copy of the table did (mean |error| 0.022 against 0.013), enough to flip the README question's
first token. The packed bytes are laid out in tiles of rows whose width depends on the CPU kernel torch picked
(64 on AVX-512, 32 on AVX2); ``row_tile`` finds it once by packing a probe, so rows can be read back (the token
embedding's lookups) and the raw blocks need not be kept beside the planes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cvllm.backends import cpu_int4mm
from cvllm_gguf.dequant import _bits, _f16, _k_scale_min, _split_bits
from cvllm_gguf.quant_types import FORMATS, GGMLType

GROUP_SIZE = 32
PLANE_TYPES = (GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q4_K,
               GGMLType.Q5_K)
WIDE_TYPES = (GGMLType.Q8_0, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K)   # two planes

_pack = torch.ops.aten._convert_weight_to_int4pack_for_cpu
_int4pack_mm = torch.ops.aten._weight_int4pack_mm_for_cpu


@dataclass(slots=True)
class Int4Planes:
    packed: torch.Tensor         # [planes * N, K / 2] uint8, the op's layout
    scales_zeros: torch.Tensor   # [K / 32, planes * N, 2]: float32 for the C kernel, else the activation dtype
    planes: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def planes_usable(qtype: GGMLType, out_features: int, in_features: int) -> bool:
    return qtype in PLANE_TYPES and out_features % 16 == 0 and in_features % GROUP_SIZE == 0


def _integers(blocks: torch.Tensor, qtype: GGMLType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [n_blocks, block elements], a, b float32 [n_blocks, groups of 32]) with w = a q + b."""
    b = blocks
    if qtype == GGMLType.Q8_0:
        d = _f16(b, 0)
        return b[:, 2:] ^ 0x80, d, -128 * d
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        at = 2 if qtype in (GGMLType.Q4_0, GGMLType.Q5_0) else 4
        d = _f16(b, 0)
        if qtype in (GGMLType.Q4_0, GGMLType.Q4_1):
            q = _split_bits(b[:, at:], 16, (0, 4), 0x0F)
        else:
            q = _split_bits(b[:, at + 4:], 16, (0, 4), 0x0F) | (_bits(b[:, at:at + 4]) << 4)
        offset = {GGMLType.Q4_0: -8 * d, GGMLType.Q5_0: -16 * d}
        return q, d, offset[qtype] if qtype in offset else _f16(b, 2)
    if qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scale_min(b[:, 4:16])
        if qtype == GGMLType.Q4_K:
            q = _split_bits(b[:, 16:], 32, (0, 4), 0x0F)
        else:
            q = _split_bits(b[:, 48:], 32, (0, 4), 0x0F) | (_split_bits(b[:, 16:48], 32, range(8), 1) << 4)
        return q, d * sc.float(), -dmin * mn.float()
    raise NotImplementedError(f"no int4 plane form for {qtype.name}")


def _pack_rows(p: torch.Tensor) -> torch.Tensor:
    """The op's packed form of 4-bit integers [N, K]. Where ``row_tile`` recognised the layout, the bytes are laid
    out here with two tensor ops (the op's own conversion takes a few times longer: an LM head's is start-up time);
    elsewhere the op converts them, whole (its layout unknown, a slice of rows might not pack alike)."""
    tile = row_tile()
    if tile is not None and p.shape[0] % tile == 0:
        halves = p.view(-1, 2, tile // 2, p.shape[1])    # [row tiles, low / high nibble, tile / 2, K]
        return (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous().view(p.shape[0], -1)
    return _pack(p.to(torch.int32), 1)


def int4_planes(qweight: torch.Tensor, qtype: GGMLType, in_features: int,
                dtype: torch.dtype = torch.bfloat16) -> Int4Planes:
    """Raw GGUF rows [N, bytes_per_row] (a ``planes_usable`` type and shape) as ``Int4Planes``."""
    n = qweight.shape[0]
    q, a, b = _integers(qweight.reshape(-1, FORMATS[qtype].type_size), qtype)
    q, a, b = q.reshape(n, in_features), a.reshape(n, -1), b.reshape(n, -1)   # a, b: [N, K / 32]
    if qtype in WIDE_TYPES:
        # q >> 4 spans 0..15 (Q8_0) or 0..1 (Q5: stored as 8..9, so that the high plane's zero is 0)
        shift = 0 if qtype == GGMLType.Q8_0 else 8
        p = torch.cat([(q >> 4) + shift, q & 0x0F])
        scales = torch.cat([16 * a, a])
        zeros = torch.cat([torch.zeros_like(a), b + 8 * a - 16 * a * (shift - 8)])
    else:
        p, scales, zeros = q, a, 8 * a + b
    if cpu_int4mm.load() is not None and rows_readable_tile(p.shape[0]):
        dtype = torch.float32   # the C kernel's exact scales (module docstring)
    scales_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)   # [G, planes N, 2]
    return Int4Planes(_pack_rows(p), scales_zeros, p.shape[0] // n, n, in_features)


def planes_linear(x: torch.Tensor, planes: Int4Planes) -> torch.Tensor:
    """x [..., K] @ w.T, [..., N]: float32 from the C kernel (float32 scales), else in the planes' dtype."""
    sz = planes.scales_zeros
    flat = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if sz.dtype == torch.float32:
        # the kernel takes up to MAX_ROWS rows a call (each call reads the planes once)
        chunks = [cpu_int4mm.int4pack_mm(flat[i:i + cpu_int4mm.MAX_ROWS], planes.packed, sz, row_tile(),
                                         torch.float32) for i in range(0, flat.shape[0], cpu_int4mm.MAX_ROWS)]
        out = None if None in chunks else chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    if sz.dtype != torch.float32 or out is None:   # torch's op: its scales in the activation dtype
        out = _int4pack_mm(flat, planes.packed, GROUP_SIZE, sz.to(flat.dtype))
    if planes.planes == 2:
        n = planes.out_features
        out = out[:, :n] + out[:, n:]
    return out.view(*x.shape[:-1], planes.out_features)


def planes_rows(planes: Int4Planes, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the weight the planes hold, [len(ids), K] in ``dtype`` (the values the matmul uses); the
    planes' rows must be readable (``rows_readable``)."""
    tile = row_tile()
    half = tile // 2
    k, n = planes.in_features, planes.out_features
    tiles = planes.packed.view(-1, k, half)   # [row tiles, K, tile / 2]: byte j of a tile holds rows j, j + half
    out = None
    for plane in range(planes.planes):
        rows = ids.long() + plane * n
        within = rows % tile
        packed = tiles[rows // tile, :, within % half]                         # [R, K]
        p = torch.where((within >= half)[:, None], packed >> 4, packed & 0x0F).float()
        sz = planes.scales_zeros[:, rows].float().transpose(0, 1)               # [R, G, 2]
        values = (p.view(len(rows), -1, GROUP_SIZE) - 8) * sz[..., :1] + sz[..., 1:]
        out = values if out is None else out + values
    return out.reshape(len(ids), k).to(dtype)


def rows_readable(planes: Int4Planes) -> bool:
    return rows_readable_tile(planes.packed.shape[0])


def rows_readable_tile(rows: int) -> bool:
    """Whether ``rows`` packed rows are in whole tiles of a known layout (readable back; the C kernel's input)."""
    tile = row_tile()
    return tile is not None and rows % tile == 0


@functools.cache
def row_tile() -> int | None:
    """The packed layout's row tile of this process's CPU kernel ([N / tile, K, tile / 2] bytes, byte j of a tile
    holding row j in its low nibble and row j + tile / 2 in its high one), or None where it is not that layout (the
    op packs the planes, and lookups read the raw blocks)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.int32)
    packed = _pack(q, 1)
    for tile in (64, 32, 16):
        t = packed.view(-1, 64, tile // 2)
        unpacked = torch.cat([t & 0x0F, t >> 4], dim=-1).permute(0, 2, 1).reshape(128, 64)
        if torch.equal(unpacked.int(), q):
            return tile
    return None
