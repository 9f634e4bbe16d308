"""Split-KV attention's slices combined (paged_attention.py, mla_attention.py): each program of a split decode wrote an
unnormalised partial (row max, row sum, accumulator) to a workspace [T, H, NUM_SPLITS] (and [.., D]); a small
kernel adds them up a head at a time (``combine_splits``), and may write the output's int8 form for the output
projection's low-bit GEMV (``quantize_heads``, int8_activations.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.int8_activations import quantize_blocks
from cvllm_cuda.kernels.pdl import launch_next_kernel, wait_for_previous_kernel
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
def _combine_splits_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr, packs_ptr, xd_ptr, sums_ptr, block_sums_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, INT8_BITS: tl.constexpr,
    USE_PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr = False,
):
    wait_for_previous_kernel(USE_PDL, LATE_TRIGGER)
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
    launch_next_kernel(USE_PDL, LATE_TRIGGER)   # (pdl.LATE_TRIGGER: the partials are in)
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
        LATE_TRIGGER=pdl.LATE_TRIGGER, **pdl.options(out.device))
