"""The packed layouts, with hand-built words: each unpacked value must land at the position the format documents."""

from __future__ import annotations

import pytest
import torch

from cvllm_marlin.packing import (
    AWQ_UNPACK_ORDER,
    dequantize_awq,
    dequantize_gptq,
    pack_awq,
    pack_columns,
    pack_rows,
    unpack_awq,
    unpack_columns,
    unpack_rows,
)


def word(*fields: int, bits: int = 4) -> int:
    """An int32 whose field k (bits*k .. bits*k + bits - 1) is fields[k]."""
    value = sum(f << (bits * k) for k, f in enumerate(fields))
    return value - (1 << 32) if value >= 1 << 31 else value


def test_gptq_qweight_packs_along_the_input_dim():
    # 8 inputs x 2 outputs, 4-bit: one word per output column; input i of output o is 2*i + o
    qweight = torch.tensor([[word(*range(0, 16, 2)), word(*range(1, 16, 2))]], dtype=torch.int32)
    q = unpack_rows(qweight, 4)
    assert q.shape == (8, 2)
    assert q.tolist() == [[2 * i, 2 * i + 1] for i in range(8)]


def test_gptq_qweight_8bit_and_the_sign_bit():
    # 4 inputs per word; 255 in the top byte makes the int32 negative: the unpacking must not sign-extend
    qweight = torch.tensor([[word(1, 2, 3, 255, bits=8)], [word(200, 0, 17, 128, bits=8)]], dtype=torch.int32)
    assert qweight[0, 0] < 0
    assert unpack_rows(qweight, 8).flatten().tolist() == [1, 2, 3, 255, 200, 0, 17, 128]


def test_gptq_qzeros_pack_along_the_output_dim():
    qzeros = torch.tensor([[word(*range(8)), word(*range(8, 16))], [word(15, 14, 13, 12, 11, 10, 9, 8), 0]],
                          dtype=torch.int32)
    z = unpack_columns(qzeros, 4)
    assert z.shape == (2, 16)
    assert z[0].tolist() == list(range(16))
    assert z[1].tolist() == [15, 14, 13, 12, 11, 10, 9, 8] + [0] * 8


def test_awq_interleave():
    # AutoAWQ puts column AWQ_PACK_ORDER[k] = (0, 2, 4, 6, 1, 3, 5, 7)[k] of each 8 in nibble k
    values = [3, 5, 7, 9, 11, 13, 15, 1]                     # column c holds values[c]
    nibbles = [values[c] for c in (0, 2, 4, 6, 1, 3, 5, 7)]  # what the file's word holds, lowest nibble first
    packed = torch.tensor([[word(*nibbles), word(*nibbles[::-1])]], dtype=torch.int32)
    unpacked = unpack_awq(packed)
    assert unpacked[0, :8].tolist() == values
    assert AWQ_UNPACK_ORDER == (0, 4, 1, 5, 2, 6, 3, 7)
    # the second word's nibbles reversed: column c is nibble 7 - AWQ_UNPACK_ORDER[c]
    assert unpacked[0, 8:].tolist() == [nibbles[::-1][AWQ_UNPACK_ORDER[c]] for c in range(8)]


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_helpers_invert_unpacking(bits):
    values = torch.randint(0, 2 ** bits, (32, 16), generator=torch.Generator().manual_seed(bits))
    assert torch.equal(unpack_rows(pack_rows(values, bits), bits), values.to(torch.int32))
    assert torch.equal(unpack_columns(pack_columns(values, bits), bits), values.to(torch.int32))
    if bits == 4:
        assert torch.equal(unpack_awq(pack_awq(values)), values.to(torch.int32))


def test_gptq_dequantize_v1_zeros_and_act_order_groups():
    # 8 inputs, 8 outputs, 2 groups of 4 with a permuted g_idx; q = 9 everywhere, zero z (stored z - 1)
    g_idx = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0], dtype=torch.int32)
    qweight = torch.full((1, 8), word(*[9] * 8), dtype=torch.int32)
    stored_zeros = [[7] * 8, [0] * 8]           # v1: zeros 8 and 1
    qzeros = torch.tensor([[word(*row)] for row in stored_zeros], dtype=torch.int32)
    scales = torch.tensor([[0.5] * 8, [2.0] * 8], dtype=torch.float16)
    weight = dequantize_gptq(qweight, qzeros, scales, g_idx, bits=4, zero_offset=1)
    assert weight.shape == (8, 8)                # [out, in]
    expected_by_group = {0: 0.5 * (9 - 8), 1: 2.0 * (9 - 1)}
    assert weight[0].tolist() == [expected_by_group[int(g)] for g in g_idx]
    # v1's zero 0 is stored as -1, i.e. 15 in its nibble: read back as 0
    qzeros_wrapped = torch.tensor([[word(*[15] * 8)]], dtype=torch.int32)
    w0 = dequantize_gptq(qweight, qzeros_wrapped, scales[:1], torch.zeros(8, dtype=torch.int32), 4, 1)
    assert w0.unique().tolist() == [0.5 * 9]
    # gptq_v2 stores the zero itself
    w2 = dequantize_gptq(qweight, qzeros[:1], scales[:1], torch.zeros(8, dtype=torch.int32), 4, 0)
    assert w2.unique().tolist() == [0.5 * (9 - 7)]


def test_gptq_dequantize_rejects_groups_the_layer_lacks():
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="g_idx names groups 0..2 but this layer holds groups 0..1"):
        dequantize_gptq(qweight, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 8),
                        torch.tensor([0, 1, 2, 0, 0, 0, 0, 0]), 4)


def test_awq_dequantize_groups_of_consecutive_inputs():
    # 4 inputs in groups of 2, 8 outputs; q[i, c] = i + c, zero 1 for group 0 and 2 for group 1
    q = torch.tensor([[i + c for c in range(8)] for i in range(4)])
    zeros = torch.tensor([[1] * 8, [2] * 8])
    scales = torch.tensor([[1.0] * 8, [0.25] * 8], dtype=torch.float16)
    weight = dequantize_awq(pack_awq(q), pack_awq(zeros), scales, group_size=2)
    expected = torch.tensor([[(i + c - (1 if i < 2 else 2)) * (1.0 if i < 2 else 0.25) for i in range(4)]
                             for c in range(8)])
    assert torch.equal(weight, expected)
    one_group = dequantize_awq(pack_awq(q), pack_awq(zeros[:1]), scales[:1], group_size=-1)
    assert torch.equal(one_group, (q - 1).t().float())
