"""The gated activation computed by the down projection's GEMV as it loads x (kernels/gated_input.py,
CVLLM_GATED_GEMV=1): the tensor-core GEMV on a gate+up output against the activation kernel then the GEMV (its fast
exp and division: an input may be one bf16 ulp off, rarely), and the hand-over from silu_and_mul to quant_matmul, with
the activation computed first wherever another kernel takes that x."""

from __future__ import annotations

import dataclasses
import os
import weakref
from types import SimpleNamespace

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels import gated_input, quant_gemv_mma  # noqa: E402
from cvllm_cuda.kernels.activation import silu_and_mul  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_linear, quant_matmul, routes_to_mma  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(),
                                reason="needs Triton's interpreter or a CUDA GPU")
K = 256   # the down projection's inputs (the MLP's intermediate size)


def gate_up_rows(t: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(t, 2 * K, generator=gen)).to(torch.bfloat16).to(DEVICE)


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("splits", [1, 2])
def test_the_gemv_on_gate_up_matches_the_activation_then_the_gemv(t, splits):
    weight = random_weight(LAYOUTS["gptq4_g128"], 64, K, DEVICE, seed=t)
    gate_up = gate_up_rows(t, seed=splits)
    x = silu_and_mul(gate_up)
    separate = torch.full((t, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    quant_gemv_mma.quant_gemv_mma(x, weight, separate, warps=2, splits=splits)
    placeholder = torch.full_like(x, float("nan"))   # never read
    fused = torch.full_like(separate, float("nan"))
    quant_gemv_mma.quant_gemv_mma(placeholder, weight, fused, warps=2, splits=splits, gated_from=gate_up)
    assert_close_to(fused, separate)


def assert_close_to(fused: torch.Tensor, separate: torch.Tensor) -> None:
    """Sums of 256 products whose inputs differ by a bf16 ulp at most, rarely: nearly every output the same bits, the
    rest within the output's rounding."""
    assert (fused == separate).float().mean() >= 0.9
    torch.testing.assert_close(fused.float(), separate.float(), rtol=2 ** -7, atol=2 ** -8 * separate.abs().max())


def down_layer(weight, **extra):
    return SimpleNamespace(quant_weight=weight, **extra)


@pytest.mark.parametrize("t", [1, 5])
def test_silu_and_mul_leaves_its_work_to_the_gemv(monkeypatch, t):
    monkeypatch.setattr(gated_input, "ENABLED", True)
    weight = random_weight(LAYOUTS["gptq4_g128"], 64, K, DEVICE, seed=t)
    gate_up = gate_up_rows(t, seed=t)
    expected = quant_matmul(silu_and_mul(gate_up), weight)
    launches = []
    gemv = quant_gemv_mma.quant_gemv_mma

    def recorded(*args, gated_from=None, **kwargs):
        launches.append(gated_from)
        return gemv(*args, gated_from=gated_from, **kwargs)

    monkeypatch.setattr(quant_gemv_mma, "quant_gemv_mma", recorded)
    x = silu_and_mul(gate_up, feeds=down_layer(weight))
    assert weight.gated is not None and weight.gated[0] is x
    out = quant_linear(x.view(1, t, K), weight)   # a reshape between, as a model's MLP has
    assert launches[-1] is not None and weight.gated is None
    assert_close_to(out.view(t, 64), expected)


def test_another_kernel_gets_the_activation_computed_first(monkeypatch):
    """Left to the GEMV, then that x goes to another kernel (the tensor-core GEMV switched off after the hand-over):
    the activation is computed into x before it, and the product is the plain one."""
    monkeypatch.setattr(gated_input, "ENABLED", True)
    weight = random_weight(LAYOUTS["gptq4_g128"], 64, K, DEVICE, seed=7)
    gate_up = gate_up_rows(2, seed=7)
    x = silu_and_mul(gate_up, feeds=down_layer(weight))
    assert weight.gated is not None
    monkeypatch.setattr(quant_gemv_mma, "ENABLED", False)
    out = quant_matmul(x, weight)
    assert torch.equal(x, silu_and_mul(gate_up))
    assert torch.equal(out, quant_matmul(silu_and_mul(gate_up), weight))


def test_what_is_not_left_to_the_gemv(monkeypatch):
    weight = random_weight(LAYOUTS["gptq4_g128"], 64, K, DEVICE, seed=1)
    gate_up = gate_up_rows(2)
    silu_and_mul(gate_up, feeds=down_layer(weight))
    assert weight.gated is None                       # switched off (the default)
    monkeypatch.setattr(gated_input, "ENABLED", True)
    for layer in (down_layer(weight, quant_perm=torch.arange(K)),    # act-order: the inputs reordered first
                  SimpleNamespace(quant_parts=[(0, weight)])):          # parts of different types
        out = silu_and_mul(gate_up, feeds=layer)
        assert weight.gated is None and torch.equal(out, silu_and_mul(gate_up))
    assert routes_to_mma(weight, 8, torch.bfloat16) and not routes_to_mma(weight, 9, torch.bfloat16)
    silu_and_mul(gate_up_rows(9), feeds=down_layer(weight))   # 9 rows: the swapped GEMM's
    assert weight.gated is None
    int8_weight = random_weight(dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True), 64, K, DEVICE,
                                seed=2)   # the int8 GEMV's (as GGUF and --isq Q4_K weights are made)
    assert not routes_to_mma(int8_weight, 1, torch.bfloat16)
    silu_and_mul(gate_up, feeds=down_layer(int8_weight))
    assert int8_weight.gated is None


def test_a_stale_hand_over_is_dropped(monkeypatch):
    monkeypatch.setattr(gated_input, "ENABLED", True)
    weight = random_weight(LAYOUTS["gptq4_g128"], 64, K, DEVICE, seed=3)
    held = weakref.ref(silu_and_mul(gate_up_rows(1), feeds=down_layer(weight)))   # its GEMV never ran (a forward
    assert held() is not None   # pass cut short): held, so no later tensor is given its memory and passes for it
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEVICE)
    out = quant_matmul(x, weight)
    assert weight.gated is None and torch.equal(out, quant_matmul(x, weight))
