"""GPTQ and AWQ layers in the CUDA backend's low-bit plane layout (cvllm_cuda/quant_planes.py), losslessly.

Both formats compute ``s * (q - z)`` per group of G input features, which the plane layout writes as
``q * D + D * (-z)``: D = the scales (float32: exact for fp16 and bf16 scales), B = the zeros (uint8, times
``b_const`` -1), one group for A/B and D/M alike. With fp16/bf16 scales every product and the sum are exact in
float32, so the planes dequantize to ``packing.dequantize_gptq`` / ``dequantize_awq`` bit for bit.

- GPTQ's ``qweight`` [K/pack, N] already is the low plane (input features packed into words in order): used as
  stored when g_idx is ``i // G``.
- GPTQ act-order (desc_act): g_idx maps inputs to groups through a permutation. When every output shard of the
  layer has the same g_idx and each group holds exactly G inputs, the inputs are reordered by group (a stable
  sort of g_idx) and the rows repacked in that order; the matmul then reads ``x.index_select(-1, perm)``.
- AWQ's ``qweight`` [K, N/8] is packed along the output dim (interleaved): unpacked and repacked along K.

Anything else (shards whose g_idx differ, uneven groups such as a row-parallel rank's part under act-order, K or G
not a multiple of 32) gives None: the layer keeps the dequantized path, and why is logged once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from cvllm_cuda.quant_planes import GROUP, QuantLayout, QuantWeight, pack_plane
from cvllm_marlin.packing import unpack_awq, unpack_columns, unpack_rows

logger = logging.getLogger(__name__)

# unpacked integers held at once while repacking (int64 inside pack_plane: 128 MiB), so a large layer's repack on
# the GPU needs little more memory than its planes
CHUNK_ELEMENTS = 1 << 24


class Planes(NamedTuple):
    weight: QuantWeight
    perm: torch.Tensor | None   # int64 [K]: the planes' input order (None: the checkpoint's own)


# GPTQ/AWQ's batch-1 products (up to 5 rows) on x rounded to int8 per 32 inputs, llama.cpp's numerics for its own
# formats (cvllm_cuda/kernels/quant_gemv_int8.py: integer dot products, under one instruction a weight against the
# float GEMV's ~4), instead of the checkpoint's W4A16 (bf16 x, Marlin's numerics, the default): an opt-in trade of
# the activations' rounding (a relative error ~0.4% per 32 inputs) for batch-1 speed; not yet timed on the H200
# (written 2026-12-05 without a device: `bench/quant_gemv_stack.py --layouts gptq4_g128,gptq4_g128_int8`)
INT8_ACTIVATIONS_ENV = "CVLLM_GPTQ_INT8_ACTIVATIONS"


def layout(bits: int, group: int) -> QuantLayout:
    """``s * (q - z)`` with s and z per ``group`` input features (int8 activations where INT8_ACTIVATIONS_ENV is 1)."""
    return QuantLayout(bits, 0, scale_group=group, super_group=group, a_mode=0, b_mode=2, b_const=-1, has_m=False,
                       int8_activations=os.environ.get(INT8_ACTIVATIONS_ENV, "0") == "1")


def gptq_planes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int,
                group_size: int, zero_offset: int = 1, group_start: int = 0, where: str = "") -> Planes | None:
    """The planes of a GPTQ layer (qweight [K/pack, N], qzeros [groups, N/pack], scales [groups, N], g_idx [K] or
    one row per output shard [shards, K]); ``group_start``: the first group a row-parallel rank holds."""
    k, n = qweight.shape[0] * (32 // bits), qweight.shape[1]
    group = _group(k, group_size, scales.shape[0], where)
    if group is None:
        return None
    g_idx = g_idx.reshape(-1, k)
    if not (g_idx == g_idx[0]).all():
        return _fallback(where, "shards", "its output shards have different g_idx (act-order per shard)")
    local = g_idx[0].to(torch.long) - group_start
    perm = torch.argsort(local, stable=True)
    if not torch.equal(local[perm], torch.arange(k, device=local.device) // group):
        return _fallback(where, "uneven", f"its g_idx does not put {group} of its {k} input features in each of "
                                          f"its {scales.shape[0]} groups (a row-parallel part under act-order?)")
    if torch.equal(perm, torch.arange(k, device=perm.device)):
        low, perm = qweight.contiguous(), None   # g_idx is i // G: the checkpoint's words are the plane
    else:
        low = _repack(lambda c0, c1: unpack_rows(qweight[:, c0:c1], bits)[perm], k, n, bits, 1,
                      qweight.device)
    zeros = (unpack_columns(qzeros, bits) + zero_offset) & ((1 << bits) - 1)
    return Planes(_weight(bits, group, n, k, low, scales, zeros), perm)


def awq_planes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               where: str = "") -> Planes | None:
    """The planes of an AWQ (GEMM) layer: qweight [K, N/8], qzeros [groups, N/8], scales [groups, N]."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = _group(k, group_size, scales.shape[0], where)
    if group is None:
        return None
    low = _repack(lambda c0, c1: unpack_awq(qweight[:, c0 // 8:c1 // 8]), k, n, 4, 8, qweight.device)
    return Planes(_weight(4, group, n, k, low, scales, unpack_awq(qzeros)), None)


def layer_planes(method, layer: nn.Module) -> Planes | None:
    """The planes of a loaded GPTQ or AWQ layer (``method``: its PackedLinearMethod), all output shards of a
    fused layer side by side along N; None where it keeps the dequantized path."""
    cfg, where = method.config, method.layer_name or type(layer).__name__
    # .data: plain tensors, which the planes may share (GPTQ's qweight, float32 scales) and keep once the layer
    # releases its parameters' data
    qweight, qzeros, scales = layer.qweight.data, layer.qzeros.data, layer.scales.data
    if method.name == "awq":
        return awq_planes(qweight, qzeros, scales, cfg.group_size, where)
    return gptq_planes(qweight, qzeros, scales, layer.g_idx.data, cfg.bits, cfg.group_size, cfg.zero_offset,
                       layer.marlin_plan["group_start"], where)


def _group(k: int, group_size: int, groups: int, where: str) -> int | None:
    """The plane group (G; -1: all K inputs of this rank), or None (logged) where the layout cannot hold it."""
    group = k if group_size == -1 else group_size
    if k % GROUP or group % GROUP or k % group:
        return _fallback(where, "shape", f"its {k} input features in groups of {group}: the planes need whole "
                                         f"groups, both multiples of {GROUP}")
    if groups * group != k:
        return _fallback(where, "uneven", f"its {groups} groups of {group} do not cover its {k} input features "
                                          f"(a row-parallel part under act-order?)")
    return group


def _repack(unpack: Callable[[int, int], torch.Tensor], k: int, n: int, bits: int, unit: int,
            device: torch.device) -> torch.Tensor:
    """The low plane int32 [K*bits/32, N] of ``unpack(c0, c1)`` (int [K, c1 - c0]: the integers of output columns
    c0..c1 in the planes' input order), a few columns at a time; ``unit``: the columns' granularity."""
    low = torch.empty((k * bits // 32, n), dtype=torch.int32, device=device)
    step = max(unit, CHUNK_ELEMENTS // max(k, 1) // unit * unit)
    for c0 in range(0, n, step):
        c1 = min(n, c0 + step)
        low[:, c0:c1] = pack_plane(unpack(c0, c1).t().contiguous(), bits)
    return low


def _weight(bits: int, group: int, n: int, k: int, low: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor) -> QuantWeight:
    return QuantWeight(layout(bits, group), n, k, low=low, high=None, d=scales.to(torch.float32).contiguous(),
                       m=None, a=None, b=zeros.to(torch.uint8).contiguous())


_logged: set[str] = set()


def _fallback(where: str, reason: str, detail: str) -> None:
    if reason not in _logged:   # once per reason: a model has hundreds of layers alike
        _logged.add(reason)
        logger.info("%s keeps the dequantized weight (and later layers for the same reason): %s", where, detail)
    return None
