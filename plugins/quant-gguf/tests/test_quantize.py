"""Quantization equals gguf.quants.quantize (numpy) byte for byte for the legacy types."""

import gguf
import numpy as np
import pytest
import torch

from cvllm_gguf.dequant import dequantize
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.quantize import quantize

LEGACY = [GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0]


def reference(x: np.ndarray, qtype: GGMLType) -> np.ndarray:
    with np.errstate(over="ignore"):  # the huge-value block overflows f16 scales on purpose
        out = gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(qtype)))
    return out if out.dtype == np.uint8 else out.view(np.uint8)


def awkward_blocks() -> np.ndarray:
    """Blocks where rounding and tie rules decide the bytes, 32 values each."""
    ramp = np.arange(32, dtype=np.float32)
    return np.stack([
        np.zeros(32, np.float32),  # d = 0: quants at the zero point
        np.full(32, 1.5, np.float32),  # constant: max == min
        np.where(ramp % 2 == 0, 0.5, -0.5).astype(np.float32),  # |max| tie between signs: first one wins
        (ramp - 15.5) * 0.25,  # Q4_1: (x - min) / d lands on exact halves
        np.concatenate([[127.0], np.arange(31) - 15.5]).astype(np.float32),  # Q8_0: d = 1, x.5 ties
        np.concatenate([[-127.0], -(np.arange(31) - 14.5)]).astype(np.float32),
        np.linspace(-8, 7, 32, dtype=np.float32),
        np.float32(1e-30) * (ramp - 3),  # tiny: scales underflow in f16
        np.float32(1e6) * (ramp - 3),  # huge: scales overflow in f16
    ])


@pytest.mark.parametrize("qtype", LEGACY, ids=lambda t: t.name)
def test_bytes_equal_the_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    cases = [awkward_blocks().reshape(-1), awkward_blocks()[::-1].reshape(3, 96)]
    for shape, scale in [((32,), 1.0), ((4, 64), 0.01), ((96, 576), 0.05), ((3, 5, 128), 1000.0), ((1, 1536), 3e-4)]:
        cases.append((rng.standard_normal(shape) * scale).astype(np.float32))
    cases.append(rng.uniform(-1, 1, (16, 256)).astype(np.float32) + 0.5)  # one-signed blocks (min offset)
    for x in cases:
        ours = quantize(torch.from_numpy(x), qtype)
        assert ours.dtype == torch.uint8
        assert np.array_equal(ours.numpy(), reference(x, qtype)), (qtype.name, x.shape)


@pytest.mark.parametrize("qtype, bound", [("Q4_0", 0.5 / 8), ("Q4_1", 0.5 / 15), ("Q5_0", 0.5 / 16),
                                          ("Q5_1", 0.5 / 31), ("Q8_0", 0.5 / 127)])
def test_round_trip_error_is_within_half_a_step(qtype, bound):
    x = torch.randn(8, 256)
    back = dequantize(quantize(x, qtype), qtype, x.shape)
    # a block's step is d = range / levels: the error is half a step, plus the f16 rounding of d
    # (up to 2^-11 relative, times up to 31 levels) and of the min offset
    blocks, err = x.view(-1, 32), (back - x).abs().view(-1, 32)
    spread = blocks.abs().amax(-1, keepdim=True) * 2 if qtype in ("Q4_0", "Q5_0", "Q8_0") else \
        blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)
    f16_slack = blocks.abs().amax(-1, keepdim=True) * 2 ** -10
    assert (err <= spread * bound + f16_slack).all()
    assert (err > 0).any()


def test_float_types_are_plain_bytes():
    x = torch.randn(3, 8)
    assert torch.equal(quantize(x, "F32").view(torch.float32), x)
    assert torch.equal(quantize(x, "F16").view(torch.float16), x.half())
    assert np.array_equal(quantize(x, "F16").numpy(), reference(x.numpy(), GGMLType.F16))
    assert torch.equal(quantize(x, "BF16").view(torch.bfloat16), x.bfloat16())


def test_rows_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="Q8_0: rows must be a multiple of 32"):
        quantize(torch.randn(2, 48), "Q8_0")
