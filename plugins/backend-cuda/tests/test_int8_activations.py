"""int8 activations made where x is made (kernels/int8_activations.py): the RMSNorm and SiLU-and-mul kernels round
their own output for an int8-activation GEMV of that input size, bit for bit what the GEMV's own quantizer makes of
that output, and the GEMV takes them only for that very output, unchanged. In Triton's interpreter without a GPU,
compiled with one (the same tests)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels import int8_activations, quant_gemv_int8  # noqa: E402
from cvllm_cuda.kernels.activation import silu_and_mul  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_matmul  # noqa: E402
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm  # noqa: E402


@pytest.fixture
def consumers(monkeypatch):
    """A clean registry of consumers and offers, restored after the test."""
    monkeypatch.setattr(int8_activations, "_consumers", {})
    monkeypatch.setattr(int8_activations, "_offered", None)
    return int8_activations


def same_bits(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b, strict=True))


def noisy(shape, seed):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x[..., 5] = 0   # a block with a zero and one all zeros: the scale's edge cases
    x[..., 64:96] = 0
    return x.to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("bits", [4, 8, 2])
@pytest.mark.parametrize("rows", [1, 3])
def test_rms_norm_rounds_its_output_as_the_gemv_would(consumers, bits, rows):
    hidden = 384   # not a power of two: the tile's padding holds no block
    consumers.note_consumer(hidden, bits, max_rows=5)
    x, residual = noisy((rows, hidden), 1), noisy((rows, hidden), 2)
    weight = (torch.rand(hidden, generator=torch.Generator().manual_seed(3)) + 0.5).to(torch.bfloat16).to(DEVICE)
    out, _ = fused_add_rms_norm(x, residual, weight, 1e-6)
    offered = consumers.take(out, bits)
    assert offered is not None
    assert same_bits(offered, int8_activations.quantize_activations(out, bits))
    assert consumers.take(out, 8 if bits != 8 else 4) is None          # another pack order
    assert consumers.take(out.clone(), bits) is None                     # another tensor
    assert consumers.take(out.view(-1), bits) is offered                 # a view of all of it
    out.add_(1)                                                          # changed since
    assert consumers.take(out, bits) is None


def test_silu_and_mul_rounds_its_output_as_the_gemv_would(consumers):
    intermediate = 2048 + 96   # two programs of 1024 and a part of one
    consumers.note_consumer(intermediate, 4, max_rows=5)
    gate_up = noisy((2, 2 * intermediate), 4)
    out = silu_and_mul(gate_up)
    assert same_bits(consumers.take(out, 4), int8_activations.quantize_activations(out, 4))


def test_only_where_wanted(consumers):
    """Not for an input size no GEMV noted, past its rows, with two pack orders wanted for one size, or switched off."""
    consumers.note_consumer(256, 4, max_rows=5)
    weight = torch.ones(256, dtype=torch.bfloat16, device=DEVICE)
    for rows in (6,):
        fused_add_rms_norm(noisy((rows, 256), 5), None, weight, 1e-6)
        assert consumers._offered is None
    fused_add_rms_norm(noisy((1, 512), 5), None, torch.ones(512, dtype=torch.bfloat16, device=DEVICE), 1e-6)
    assert consumers._offered is None
    consumers.note_consumer(256, 8, max_rows=5)
    assert consumers.wanted(256, 1) is None
    consumers.note_consumer(512, 4, max_rows=5)
    assert consumers.wanted(512, 1) == 4
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(int8_activations.FUSED_ENV, "0")
        assert consumers.wanted(512, 1) is None


@pytest.mark.parametrize("name", ["q4_k", "q8_0"])
def test_gemv_output_the_same_bits_either_way(consumers, name):
    """A layer's GEMV after the norm that rounded its input: the same output as with its own quantizer."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    hidden = 512
    weight = random_weight(layout, 96, hidden, DEVICE, seed=6)
    quant_gemv_int8.note_consumer(weight)
    norm_weight = torch.ones(hidden, dtype=torch.bfloat16, device=DEVICE)
    x = fused_add_rms_norm(noisy((2, hidden), 7), None, norm_weight, 1e-6)
    assert consumers.take(x, layout.low_bits) is not None
    fused = quant_matmul(x, weight)
    consumers._offered = None
    assert torch.equal(quant_matmul(x, weight), fused)
