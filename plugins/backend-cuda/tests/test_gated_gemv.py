"""The gated low-bit GEMV (quant_gemv_int8.gated_gemv_int8): a fused gate + up projection and its activation in one
launch, the same bits as the projection's GEMV followed by the activation kernel (silu, gelu, gelu-tanh), with the
down projection's int8 form where it feeds one; the cases it leaves to the two launches. In Triton's interpreter
(no FMA contraction there, as none in the compiled gated kernel); compiled for sm_90 in test_sm90_compile.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, needs_gpu, random_weight  # noqa: E402

from cvllm_cuda.kernels import int8_activations, quant_tiles  # noqa: E402
from cvllm_cuda.kernels.activation import gelu_and_mul, silu_and_mul  # noqa: E402
from cvllm_cuda.kernels.gate_math import GELU, GELU_TANH, SILU  # noqa: E402
from cvllm_cuda.kernels.quant_gemv import gated_gemv, quant_gemv  # noqa: E402
from cvllm_cuda.kernels.quant_gemv_int8 import GATED_MAX_ROWS, gated_gemv_int8, quant_gemv_int8  # noqa: E402

APART = {SILU: silu_and_mul, GELU: lambda x: gelu_and_mul(x, "none"), GELU_TANH: lambda x: gelu_and_mul(x, "tanh")}


def layer_of(name: str, k: int) -> SimpleNamespace:
    """A down projection as input_bits sees it: a low-bit weight taking int8 activations."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    return SimpleNamespace(quant_weight=SimpleNamespace(layout=layout, in_features=k))


def small_x(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 activations that put the random weights' gates around -4 ... 12 (the activations' curved part, not only
    silu(g) = g)."""
    return (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 0.03).to(DEVICE).to(torch.bfloat16)


def apart(x: torch.Tensor, weight, act: int) -> torch.Tensor:
    gate_up = torch.empty(x.shape[0], weight.out_features, device=DEVICE, dtype=x.dtype)
    quant_gemv_int8(x, weight, gate_up)
    return APART[act](gate_up)


@pytest.mark.parametrize("name,act,rows", [("q4_k", SILU, 1), ("q4_k", GELU_TANH, 2), ("q8_0", SILU, GATED_MAX_ROWS),
                                           ("q8_0", GELU, 1)])
def test_gated_gemv_gives_the_projection_then_the_activation_bits(name, act, rows):
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 2 * 96, 768, DEVICE, seed=rows)
    x = small_x(rows, 768, seed=act)
    out = gated_gemv_int8(x, weight, act)
    assert out is not None and out.shape == (rows, 96) and out.dtype == torch.bfloat16
    assert torch.equal(out, apart(x, weight, act))
    assert (out < 0).any() and (out > 0).any()
    assert int8_activations.attached(out, 4) is None   # no form without a GEMV to feed


@pytest.mark.parametrize("name", ["q4_k", "q2_k", "q8_0"])
def test_gated_gemv_makes_the_int8_form_of_the_down_projection(monkeypatch, name):
    """With producers on and a low-bit down projection to feed: the output's int8 form at the down layer's width,
    the bits the quantizer makes of the output."""
    monkeypatch.setenv(int8_activations.PRODUCERS_ENV, "1")
    weight = random_weight(dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True), 2 * 64, 512, DEVICE, seed=2)
    x = small_x(2, 512, seed=2)
    down = layer_of(name, 64)
    out = gated_gemv_int8(x, weight, SILU, feeds=down)
    bits = down.quant_weight.layout.low_bits
    made = int8_activations.attached(out, bits)
    assert made is not None
    for got, want in zip(made, int8_activations.quantize_activations(out, bits), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(out, apart(x, weight, SILU))


def test_gated_gemv_sums_its_k_splits_in_its_launch(monkeypatch):
    """K 1024 splits in two in the interpreter: taken only with the fused split sums, then the same bits."""
    weight = random_weight(dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True), 2 * 64, 1024, DEVICE, seed=4)
    x = small_x(1, 1024, seed=4)
    monkeypatch.setenv(quant_tiles.FUSED_SPLITS_ENV, "0")
    assert gated_gemv_int8(x, weight, SILU) is None
    monkeypatch.setenv(quant_tiles.FUSED_SPLITS_ENV, "1")
    out = gated_gemv_int8(x, weight, SILU)
    assert out is not None and torch.equal(out, apart(x, weight, SILU))
    assert all(int(c.abs().sum()) == 0 for c in quant_tiles._counters.values())


@pytest.mark.parametrize("name,act,n", [("gptq4_g128", SILU, 2 * 96), ("fp8_block128", GELU_TANH, 2 * 40),
                                        ("q6_k", SILU, 2 * 64)])
def test_float_gemv_gated_gives_the_projection_then_the_activation_bits(monkeypatch, name, act, n):
    """The float GEMV's layouts (GPTQ's W4A16, FP8, a GGUF type on float activations), one row: 40 features a half
    is a masked last tile; K 1024 splits in two in the interpreter, summed in the launch."""
    monkeypatch.setenv(quant_tiles.FUSED_SPLITS_ENV, "1")
    weight = random_weight(LAYOUTS[name], n, 1024, DEVICE, seed=n)
    x = small_x(1, 1024, seed=n)
    out = gated_gemv(x, weight, act)
    gate_up = torch.empty(1, n, device=DEVICE, dtype=x.dtype)
    quant_gemv(x, weight, gate_up)
    assert out is not None and torch.equal(out, APART[act](gate_up))
    assert (out < 0).any() and (out > 0).any()
    monkeypatch.setenv(quant_tiles.FUSED_SPLITS_ENV, "0")
    assert gated_gemv(x, weight, act) is None                             # split, and no fused sums
    assert gated_gemv(torch.cat([x, x]), weight, act) is None             # one row only


def test_gated_gemv_leaves_what_it_does_not_take():
    lay = dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True)
    x = torch.zeros(GATED_MAX_ROWS + 1, 512, device=DEVICE, dtype=torch.bfloat16)
    assert gated_gemv_int8(x, random_weight(lay, 128, 512, DEVICE), SILU) is None           # too many rows
    assert gated_gemv_int8(x[:1], random_weight(lay, 2 * 48, 512, DEVICE), SILU) is None    # I not whole tiles
    float_gemv = LAYOUTS["gptq4_g128"]                                   # the float GEMV's (gated_gemv takes it)
    assert gated_gemv_int8(x[:1], random_weight(float_gemv, 128, 512, DEVICE), SILU) is None


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q6_k", "gptq4_g128"])
def test_gpu_gated_gemv_matches_the_two_launches(monkeypatch, name):
    """Compiled at Llama-3-8B's gate_up shape, one row: within a bf16 rounding of the projection then silu (the
    gated kernel is compiled without FMA contraction, the projection's GEMV with it: its products may round
    apart); on int8 activations its int8 form for a Q4_K down projection is the quantizer's bits of its output."""
    monkeypatch.setenv(int8_activations.PRODUCERS_ENV, "1")
    monkeypatch.setenv(quant_tiles.FUSED_SPLITS_ENV, "1")
    int8 = name != "gptq4_g128"
    weight = random_weight(dataclasses.replace(LAYOUTS[name], int8_activations=int8), 2 * 14336, 4096, DEVICE)
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16) * 0.05
    if int8:
        out = gated_gemv_int8(x, weight, SILU, feeds=layer_of("q4_k", 14336))
        want = apart(x, weight, SILU)
    else:
        out = gated_gemv(x, weight, SILU)
        gate_up = torch.empty(1, 2 * 14336, device=DEVICE, dtype=x.dtype)
        quant_gemv(x, weight, gate_up)
        want = silu_and_mul(gate_up)
    assert out is not None
    torch.testing.assert_close(out, want, rtol=1.6e-2, atol=1e-2 * want.abs().max().item())
    if int8:
        for got, form in zip(int8_activations.attached(out, 4), int8_activations.quantize_activations(out, 4),
                             strict=True):
            assert torch.equal(got, form)
