"""Dequantization equals gguf.quants.dequantize (numpy) bit for bit, for every type."""

import gguf
import numpy as np
import pytest
import torch

from cvllm_gguf.dequant import dequantize
from cvllm_gguf.quant_types import FORMATS, GGMLType, UnsupportedQuantType

LEGACY = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]


def shapes_for(qtype: GGMLType) -> list[tuple[int, ...]]:
    block = FORMATS[qtype].block_size
    return [(block,), (3, block), (5, 4 * block), (2, 3, 2 * block), (64, 8 * block), (1, 24 * block)]


def reference(raw: np.ndarray, qtype: GGMLType) -> np.ndarray:
    with np.errstate(all="ignore"):  # huge finite scales overflow to inf in both implementations
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(qtype)))


def assert_bit_equal(ours: torch.Tensor, ref: np.ndarray) -> None:
    assert ours.dtype == torch.float32
    assert tuple(ours.shape) == ref.shape
    assert np.array_equal(ours.numpy().view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", list(GGMLType), ids=lambda t: t.name)
def test_random_blocks_equal_the_reference(qtype, make_raw):
    rng = np.random.default_rng(int(qtype))
    for shape in shapes_for(qtype):
        raw = make_raw(qtype, shape, rng)
        ours = dequantize(torch.from_numpy(raw), qtype, shape)
        assert_bit_equal(ours, reference(raw, qtype))


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_quantized_random_floats_equal_the_reference(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    for shape, scale in [((4, 64), 1.0), ((96, 576), 0.02), ((7, 3, 128), 300.0)]:
        raw = gguf.quants.quantize((rng.standard_normal(shape) * scale).astype(np.float32),
                                   gguf.GGMLQuantizationType(int(qtype)))
        assert_bit_equal(dequantize(torch.from_numpy(raw), qtype, shape), reference(raw, qtype))


def test_reads_rows_from_flat_or_offset_bytes(make_raw):
    rng = np.random.default_rng(7)
    raw = make_raw(GGMLType.Q4_K, (4, 512), rng)
    ref = reference(raw, GGMLType.Q4_K)
    flat = torch.from_numpy(raw).reshape(-1)
    assert_bit_equal(dequantize(flat, "Q4_K", (4, 512)), ref)
    # a tensor that starts at an odd byte of a larger buffer (as inside a GGUF file) still decodes
    padded = torch.cat([torch.zeros(1, dtype=torch.uint8), flat])[1:]
    assert_bit_equal(dequantize(padded, "Q4_K", (4, 512)), ref)
    f32 = make_raw(GGMLType.F32, (3, 5), rng)
    shifted = torch.cat([torch.zeros(2, dtype=torch.uint8), torch.from_numpy(f32).reshape(-1)])[2:]
    assert_bit_equal(dequantize(shifted, "F32", (3, 5)), reference(f32, GGMLType.F32))


def test_f32_result_does_not_alias_the_bytes():
    raw = torch.tensor([1.5, -2.0], dtype=torch.float32).view(torch.uint8)
    out = dequantize(raw, "F32", (2,))
    raw.zero_()
    assert out.tolist() == [1.5, -2.0]


def test_f16_nan_payloads_are_kept_as_numpy_keeps_them():
    raw = np.array([0x7C01, 0xFE00, 0x7D00, 0x3C00], dtype=np.uint16).view(np.uint8)
    assert_bit_equal(dequantize(torch.from_numpy(raw), "F16", (4,)), reference(raw, GGMLType.F16))


def test_wrong_sizes_and_types_are_errors():
    raw = torch.zeros(2 * 18, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"'w' Q4_0 tensor of shape \[3, 32\] needs 54 bytes, got 36"):
        dequantize(raw, "Q4_0", (3, 32), tensor_name="w")
    with pytest.raises(ValueError, match="row length 48 is not a multiple of the Q4_0 block size 32"):
        dequantize(raw, "Q4_0", (1, 48))
    with pytest.raises(TypeError, match="uint8"):
        dequantize(raw.float(), "Q4_0", (2, 32))
    with pytest.raises(UnsupportedQuantType, match="IQ4_XS .* in tensor 'blk.0.attn_q.weight'"):
        dequantize(raw, 23, (1, 256), tensor_name="blk.0.attn_q.weight")
