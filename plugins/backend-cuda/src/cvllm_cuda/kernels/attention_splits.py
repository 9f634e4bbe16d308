"""Split-KV attention's slices combined (paged_attention.py, mla_attention.py): each program of a split decode wrote an
unnormalised partial (row max, row sum, accumulator) to a workspace [T, H, NUM_SPLITS] (and [.., D]); a small
kernel adds them up a head at a time (``combine_splits``), or the generic kernel's slice that finishes last does,
in the same launch (``combine_in_launch``, split_tickets.py), and either may write the output's int8 form for the
output projection's low-bit GEMV (``quantize_heads``, int8_activations.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.int8_activations import quantize_blocks
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import next_power_of_2


@triton.jit
def quantize_heads(o, heads, row_ok, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, HEAD_DIM: tl.constexpr,
                   INT8_BITS: tl.constexpr):
    """Where INT8_BITS is set, the int8 form of output rows ``o`` [R, BLOCK_D] that are heads ``heads`` [R] of a
    contiguous [T, H, HEAD_DIM] output (token * H + head; HEAD_DIM a multiple of 32), ``row_ok`` [R] the rows to
    store."""
    if INT8_BITS > 0:
        R: tl.constexpr = o.shape[0]
        BLOCKS: tl.constexpr = o.shape[1] // 32
        blocks = tl.arange(0, BLOCKS)
        first = heads.to(tl.int64) * (HEAD_DIM // 32)
        ok = row_ok[:, None] & (blocks < HEAD_DIM // 32)[None, :]
        quantize_blocks(tl.reshape(o.to(tl.float32), (R * BLOCKS, 32)),
                        tl.reshape(first[:, None] + blocks[None, :], (R * BLOCKS,)), tl.reshape(ok, (R * BLOCKS,)),
                        packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, INT8_BITS)


@triton.jit
def combine_in_launch(out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr,
                      token, head, row_ok, num_heads, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr, INT8_BITS: tl.constexpr):
    """Rows (``token`` [R] int64, ``head`` [R]; ``row_ok`` those to store) of the output combined from the workspace's
    NUM_SPLITS slices, by a program that holds every slice's ticket (split_tickets.last_split): the others' partials
    are read through L2 (``.cg``), CHUNK slices' accumulators loaded together (R x CHUNK x BLOCK_D floats: one load
    for a decode's few heads, not one L2 round trip a slice). As ``_combine_splits_kernel`` computes it, with the
    slices' weighted sums taken CHUNK at a time."""
    part = (token * num_heads + head) * NUM_SPLITS
    ok = row_ok[:, None]
    splits = tl.arange(0, NUM_SPLITS)
    m = tl.load(part_max_ptr + part[:, None] + splits[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_sum_ptr + part[:, None] + splits[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    m_all = tl.max(m, 1)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)   # a row no slice saw a key of: every weight 0
    total = tl.sum(tl.exp(m - m_all[:, None]) * l, 1)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.zeros((part.shape[0], BLOCK_D), dtype=tl.float32)
    for j0 in tl.range(0, NUM_SPLITS, CHUNK, loop_unroll_factor=1):
        chunk = part[:, None] + j0 + tl.arange(0, CHUNK)[None, :]   # [R, CHUNK]
        weight = tl.exp(tl.load(part_max_ptr + chunk, mask=ok, other=float("-inf"), cache_modifier=".cg")
                        - m_all[:, None])
        slices = tl.load(part_acc_ptr + chunk[:, :, None] * HEAD_DIM + dims[None, None, :],
                         mask=ok[:, :, None] & (dims < HEAD_DIM)[None, None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(slices * weight[:, :, None], 1)
    o = (acc / tl.where(total == 0.0, 1.0, total)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :], o,
             mask=ok & (dims < HEAD_DIM)[None, :])
    quantize_heads(o, token * num_heads + head, row_ok, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, HEAD_DIM,
                   INT8_BITS)


@triton.jit
def _combine_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, INT8_BITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    m = tl.load(part_max_ptr + part)
    l = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=(dims < HEAD_DIM)[None, :])
    m_all = tl.max(m, 0)
    weight = tl.exp(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # 0 for slices that saw no key
    total = tl.sum(weight * l, 0)
    o = (tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, o, mask=dims < HEAD_DIM)
    quantize_heads(tl.reshape(o, (1, BLOCK_D)), tl.full((1,), 0, tl.int64) + token * tl.num_programs(1) + head,
                   tl.full((1,), 1, tl.int1), packs_ptr, xd_ptr, sums_ptr, block_sums_ptr, HEAD_DIM, INT8_BITS)


def combine_splits(out: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor, part_acc: torch.Tensor,
                   made: tuple[torch.Tensor, ...] | None = None, int8_bits: int = 0) -> None:
    """out [T, H, D] (last dim contiguous) = the workspace's NUM_SPLITS slices combined, a program a head; with
    ``int8_bits``, their int8 form into ``made`` (int8_activations.buffers of a contiguous ``out``)."""
    num_tokens, num_heads, splits, head_dim = part_acc.shape
    _combine_splits_kernel[(num_tokens, num_heads)](
        out, part_max, part_sum, part_acc, *(made or (out,) * 4), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), NUM_SPLITS=splits, INT8_BITS=int8_bits, num_warps=4,
        **pdl.options(out.device))


def combine_chunk(rows: int, splits: int, block_d: int, warps: int) -> int:
    """Slices combine_in_launch loads together for ``rows`` rows (a power of two) in a program of ``warps`` warps: 64
    registers a thread's worth of floats at most (a batch-1 decode's 4 heads x 16 slices x 128 dims in one load at 4
    warps; sm_90 compile of the 2-warp decode tile: 168 registers a thread as before, 238 with 128 floats a thread)."""
    return max(1, min(splits, 64 * 32 * warps // (rows * block_d)))
