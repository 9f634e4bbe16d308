"""The CPU backend's C add + RMSNorm and rotary (backends/cpu_kernels.py, cpu_fused.py) against the torch code the
layers run without them: bit-equal (the norm's sum of squares in the order of torch's sum kernel) over many shapes
and scales, and the torch code itself where a kernel does not apply (float32, prefill-sized or narrow inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cvllm.backends import cpu_fused, cpu_kernels
from cvllm.backends.cpu import CpuBackend
from cvllm.backends.cpu_kind import log_kind
from cvllm.forward_context import ForwardContext, forward_context
from cvllm.layers.layernorm import RMSNorm
from cvllm.layers.rotary import get_rope

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")


def test_the_norm_kernel_is_on_by_default_and_can_be_turned_off(monkeypatch):
    assert CpuBackend().fused_add_rms_norm is not None
    monkeypatch.setenv("CVLLM_CPU_FUSED_NORM", "0")
    backend = CpuBackend()
    assert backend.fused_add_rms_norm is None and backend.rotary is not None


def test_a_norm_that_differs_from_torch_is_not_offered(monkeypatch):
    """The kernel is checked against torch once per backend: one that is not bit-equal (as the old order of the sum
    of squares was now and then) is not offered, and the layers run their torch norm."""
    monkeypatch.setattr(cpu_fused, "_norm_matches_torch", lambda kernel: False)
    assert CpuBackend().fused_add_rms_norm is None


def torch_norm(x, residual, weight, eps):
    if residual is None:
        return weight * F.rms_norm(x, weight.shape, eps=eps)
    x = x + residual
    return weight * F.rms_norm(x, weight.shape, eps=eps), x


# widths: narrow, odd tails, the cascade's first level (>= 512) and beyond; the demo's 576, larger models' widths
WIDTHS = [16, 17, 23, 64, 100, 255, 511, 512, 513, 576, 960, 1000, 1536, 2048, 2049, 3072, 4096, 5120, 8192, 16384]


@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_is_bit_equal_to_the_torch_code(cols, with_residual):
    """Every row of each width at four scales (1e-3 .. 1e2, one outlier feature as real activations have), 1 to 64
    rows a call: the same bf16 bits as RMSNorm's torch code."""
    backend = CpuBackend()
    gen = torch.Generator().manual_seed(cols)
    for rows, scale in ((1, 1e-3), (7, 1.0), (64, 8.0), (64, 100.0)):
        x = (torch.randn(rows, cols, generator=gen) * scale).bfloat16()
        x[:, cols // 3] *= 40
        residual = (torch.randn(rows, cols, generator=gen) * scale).bfloat16() if with_residual else None
        weight = torch.randn(cols, generator=gen).bfloat16()
        ours, theirs = backend.fused_add_rms_norm(x, residual, weight, 1e-5), torch_norm(x, residual, weight, 1e-5)
        if with_residual:
            assert torch.equal(ours[1], theirs[1])
            ours, theirs = ours[0], theirs[0]
        assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs), (rows, scale)


def test_nan_and_inf_propagate_as_in_torch():
    backend = CpuBackend()
    x = torch.ones(2, 64, dtype=torch.bfloat16)
    x[0, 5], x[1, 9] = float("nan"), float("inf")
    weight = torch.ones(64, dtype=torch.bfloat16)
    ours, theirs = backend.fused_add_rms_norm(x, None, weight, 1e-6), torch_norm(x, None, weight, 1e-6)
    assert torch.equal(ours.isnan(), theirs.isnan())


def in_forward_pass(backend, call):
    """``call()`` inside a forward pass on ``backend``: the layers read its kernels (backends/base.forward_backend)."""
    with forward_context(ForwardContext(backend, *([None] * 4), [], [], [], 1, 1, True)), torch.inference_mode():
        return call()


@pytest.mark.parametrize("dtype,rows,cols", [(torch.float32, 1, 64), (torch.bfloat16, 65, 64), (torch.bfloat16, 3, 8)])
def test_outside_the_kernel_the_layer_runs_its_torch_code(dtype, rows, cols):
    """The kernel declines what it does not take (float32, prefill-sized inputs, rows narrower than torch's vector
    sum) and RMSNorm computes it itself."""
    backend = CpuBackend()
    x, residual = torch.randn(rows, cols).to(dtype), torch.randn(rows, cols).to(dtype)
    norm = RMSNorm(cols, eps=1e-5)
    norm.weight.data = torch.rand(cols).to(dtype)
    assert backend.fused_add_rms_norm(x, residual, norm.weight, 1e-5) is None
    ours, theirs = in_forward_pass(backend, lambda: norm(x, residual)), torch_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_the_layer_takes_the_kernel_inside_a_forward_pass():
    backend = CpuBackend()
    assert backend.fused_add_rms_norm is not None and RMSNorm._fusable
    assert "CPU kernels: torch" in log_kind()


@pytest.mark.parametrize("rows", [1, 9, 64, 65])
def test_rotary_is_the_layers_own_rounding(rows):
    """neox rotary of q and k (views into one qkv row, as the attention layers pass them): bit-equal to
    RotaryEmbedding's torch code, in C up to 64 rows and through that code beyond."""
    backend = CpuBackend()
    rope = get_rope(64, 4096, {"rope_type": "default", "rope_theta": 100000.0})
    gen = torch.Generator().manual_seed(rows)
    q, k, _ = (torch.randn(rows, 960, generator=gen) * 3).bfloat16().split([576, 192, 192], dim=-1)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    kernel = backend.rotary(positions, q, k, rope.cos_sin_for(positions, q), 64)
    assert (kernel is None) == (rows > cpu_kernels.MAX_ROWS)   # beyond: declined, the layer's torch code runs
    ours = in_forward_pass(backend, lambda: rope(positions, q, k))
    theirs = rope(positions, q, k)   # outside a forward pass: the layer's torch code
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    if kernel is not None:
        assert torch.equal(kernel[0], theirs[0]) and torch.equal(kernel[1], theirs[1])


def test_partial_and_interleaved_rotary_run_the_torch_code():
    """The kernel declines partial and interleaved rotary; the layer inside a forward pass then gives its torch
    code's numbers."""
    backend = CpuBackend()
    q, k = torch.randn(3, 4 * 64).bfloat16(), torch.randn(3, 2 * 64).bfloat16()
    positions = torch.tensor([0, 5, 9])
    for rope in (get_rope(64, 64, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                 get_rope(64, 64, {"rope_type": "default", "rope_theta": 1e4}, interleaved=True)):
        extra = {"interleaved": True} if rope.interleaved else {}
        assert backend.rotary(positions, q, k, rope.cos_sin_for(positions, q), 64, **extra) is None
        ours = in_forward_pass(backend, lambda rope=rope: rope(positions, q, k))
        theirs = rope(positions, q, k)   # outside a forward pass: no backend kernel at all
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
