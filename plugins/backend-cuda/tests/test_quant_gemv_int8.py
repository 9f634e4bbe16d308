"""The int8-activation GEMV (kernels/quant_gemv_int8.py: llama.cpp's numerics for GGUF layouts without a high plane,
1 to MAX_ROWS rows of x) against the rounded-activation reference; every row's bits as when alone, whether its
program takes one row or several. In Triton's interpreter without a GPU, compiled with one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, needs_gpu, random_weight  # noqa: E402

from cvllm_cuda.kernels import quant_gemv_int8  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_matmul  # noqa: E402
from cvllm_cuda.quant_planes import QuantLayout, dequantize_planes  # noqa: E402


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q2_k"])
def test_gpu_int8_gemv_rows_together_change_no_bit(name):
    """Compiled, at a Llama-shaped K and the default tiles and splits: the rows of x together in a program
    (rows_per_program) give every row the bits it gets in a program of its own, and alone."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 1000, 4096, DEVICE, seed=7)
    rows = quant_gemv_int8.MAX_ROWS
    x = torch.randn(rows, 4096, device=DEVICE, dtype=torch.bfloat16)
    outs = []
    for per_program in (1, 2, rows):
        outs.append(torch.empty(rows, 1000, device=DEVICE, dtype=torch.bfloat16))
        quant_gemv_int8.quant_gemv_int8(x, weight, outs[-1], rows_per_program=per_program)
    alone = torch.empty(1, 1000, device=DEVICE, dtype=torch.bfloat16)
    quant_gemv_int8.quant_gemv_int8(x[2:3], weight, alone)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]) and torch.equal(outs[2][2:3], alone)


@pytest.mark.parametrize("name", ["q4_k", "q4_0", "q8_0", "q2_k", "gptq4_g128"])
@pytest.mark.parametrize("config,n", [(None, 21), ((16, 8, 4), 21), ((16, 8, 4), 48), ((16, 32, 4), 32)])
def test_int8_activation_gemv_equals_the_rounded_reference(name, config, n):
    """llama.cpp's numerics: x rounded to int8 per 32 inputs, integer dot products. Against dequantize-then-matmul
    of the same rounded x (float32 sums in another order), and against the float x within the rounding's error.
    Output features a multiple of the tile (n 48, 32) take the kernel's unmasked form; the 4-bit and 8-bit GGUF
    groups (one activation block) add their words' products as integers, GPTQ's and Q2_K's per word."""
    layout = dataclasses.replace(LAYOUTS.get(name) or QuantLayout(4, 0, 32, 32, b_const=-8), int8_activations=True)
    weight = random_weight(layout, n, 1024, DEVICE, seed=11)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    x[0, 40:64] = 0.0   # an all-zero block of 32 has scale 0
    assert quant_gemv_int8.applies(layout, 1024)
    out = torch.full((1, n), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x, weight, out, config)
    w = dequantize_planes(weight).to(DEVICE)
    ref = quant_gemv_int8.dequantized_activations(x) @ w.T
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    exact = x @ w.T
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 2e-2
    # the T=1 dispatch takes it (its own tiles: the same sums in another order)
    torch.testing.assert_close(quant_matmul(x, weight).cpu(), out.cpu(), rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q2_k"])
@pytest.mark.parametrize("splits", [None, 3])   # None: the default (2 in the interpreter at K 1024)
def test_a_few_rows_take_the_int8_gemv_each_row_as_if_alone(name, splits):
    """Up to MAX_ROWS rows (a decode batch, a speculative verify step) go through the int8 GEMV, every row's output
    bit for bit what that row alone gives (so a verify step's logits round as the plain steps' do), with the K split
    in parts and into rows of a wider output; past MAX_ROWS, the float GEMM."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 24, 1024, DEVICE, seed=13)
    rows = quant_gemv_int8.MAX_ROWS
    x = torch.randn(rows + 1, 1024, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    alone = torch.cat([quant_matmul(x[i:i + 1], weight) for i in range(rows)])
    wide = torch.full((rows, 40), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x[:rows], weight, wide[:, 8:32], splits=splits)
    if splits is None:
        assert torch.equal(quant_matmul(x[:rows], weight), alone)
        assert torch.equal(quant_matmul(x[:3], weight), alone[:3])
        assert torch.equal(wide[:, 8:32], alone)
    else:   # the sums of 3 parts: not the default split's bits, the same numbers within float32 rounding
        torch.testing.assert_close(wide[:, 8:32].cpu(), alone.cpu(), rtol=1e-5, atol=1e-5 * alone.abs().max().item())
    assert wide[:, :8].isnan().all() and wide[:, 32:].isnan().all()
    w = dequantize_planes(weight).to(DEVICE)
    rounded = quant_gemv_int8.dequantized_activations(x[:rows]) @ w.T
    torch.testing.assert_close(alone.cpu(), rounded.cpu(), rtol=1e-5, atol=1e-5 * rounded.abs().max().item())
    # one row more: the float GEMM (x not rounded)
    torch.testing.assert_close(quant_matmul(x, weight).cpu(), (x @ w.T).cpu(), rtol=1e-5,
                               atol=1e-5 * rounded.abs().max().item())


@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q2_k"])
def test_int8_gemv_rows_together_or_apart_give_the_same_bits(name):
    """A program takes several rows of x (each weight tile loaded and unpacked once for all of them) or one: every
    row's output is the same bits, also from a last program with fewer rows (which repeats its last row and stores
    it once)."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 24, 1024, DEVICE, seed=17)
    rows = quant_gemv_int8.MAX_ROWS
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    outs = {}
    for per_program in (1, 2, rows):
        outs[per_program] = torch.full((rows, 24), float("nan"), device=DEVICE)
        quant_gemv_int8.quant_gemv_int8(x, weight, outs[per_program], rows_per_program=per_program)
    assert torch.equal(outs[1], outs[2]) and torch.equal(outs[1], outs[rows])
    alone = torch.full((1, 24), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x[-1:], weight, alone)
    assert torch.equal(outs[2][-1:], alone)


def test_int8_activations_are_off_for_high_planes_fp8_and_the_switch(monkeypatch):
    assert not quant_gemv_int8.applies(dataclasses.replace(LAYOUTS["q6_k"], int8_activations=True), 1024)
    assert not quant_gemv_int8.applies(LAYOUTS["q4_k"], 1024)   # not set: GPTQ's W4A16, FP8
    on = dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True)
    monkeypatch.setenv(quant_gemv_int8.ENV, "0")
    assert not quant_gemv_int8.applies(on, 1024)


def test_rows_go_together_in_a_program_only_on_a_large_layer():
    """The default: rows together where the weight stream is the cost (a Llama-3-8B layer), a program a row on the
    demo model's small layers (more programs in parallel), one row alone either way."""
    if quant_gemv_int8.ROWS_PER_PROGRAM:
        pytest.skip("CVLLM_GEMV_ROWS_PER_PROGRAM is set")
    assert quant_gemv_int8.program_rows(5, 4096, 4096) == 5
    assert quant_gemv_int8.program_rows(3, 28672, 4096) == 3
    assert quant_gemv_int8.program_rows(5, 960, 576) == 1
    assert quant_gemv_int8.program_rows(1, 4096, 4096) == 1
