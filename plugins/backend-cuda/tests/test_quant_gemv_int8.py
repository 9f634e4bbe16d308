"""The int8-activation GEMV (kernels/quant_gemv_int8.py: llama.cpp's numerics for the GGUF layouts, those with a high
plane too, 1 to MAX_ROWS rows of x) against the rounded-activation reference; every row's bits as when alone,
whether its program takes one row or several. The high-plane layouts' weights are random GGUF blocks repacked by
cvllm_gguf (the files' bit order) and checked against the GGUF dequantizer. In Triton's interpreter without a GPU,
compiled with one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, needs_gpu, random_weight  # noqa: E402

from cvllm_cuda.kernels import quant_gemv, quant_gemv_int8, quant_tiles  # noqa: E402
from cvllm_cuda.kernels.int8_activations import dequantized_activations  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_matmul  # noqa: E402
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight, dequantize_planes  # noqa: E402


# the GGUF types with a high plane (cvllm_gguf.planes.LAYOUTS: Q6_K 4 + 2 bits, Q5_* 4 + 1, Q3_K 2 + 1) and the byte
# offsets of their blocks' f16 scales
@pytest.fixture(autouse=True)
def high_planes_on(monkeypatch):
    """The high-plane layouts take the int8 GEMV (quant_gemv_int8.HIGH_PLANES_ENV): on even where a run says "0"."""
    monkeypatch.setenv(quant_gemv_int8.HIGH_PLANES_ENV, "1")


HIGH_PLANE_TYPES = {"Q6_K": (208,), "Q5_K": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q3_K": (108,)}


def gguf_weight(name: str, n: int, k: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    """A [n, k] weight of random GGUF blocks (random quants and high bits, small finite scales) repacked into planes
    by cvllm_gguf, and the GGUF dequantizer's float32 values of the same blocks (independent of the planes)."""
    pytest.importorskip("cvllm_gguf")
    from cvllm_gguf.dequant import dequantize
    from cvllm_gguf.planes import to_planes
    from cvllm_gguf.quant_types import FORMATS, GGMLType
    qtype = GGMLType[name]
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n * k // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for at in HIGH_PLANE_TYPES[name]:
        scales = rng.uniform(1e-3, 1e-2, size=blocks.shape[0]).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    raw = torch.from_numpy(blocks.reshape(n, -1))
    return to_planes(raw, qtype, k).to(DEVICE), dequantize(raw, qtype, (n, k)).float().to(DEVICE)


def assert_rounded_reference(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """``out`` is x rounded to int8 per 32 inputs times ``w`` (float64 reference; float32 sums in another order).

    An input whose x / d lies within float32 rounding of a half step may round either way: the kernel multiplies by
    1 / d as llama.cpp does, the reference divides, and a GPU's float32 divisions are approximate (in IEEE float32
    the two disagree on ~1 normal input in 1.6 million; likely why the Q3_K case failed on an H100 with unseeded x).
    Each input within 8 ulps of a half step widens its outputs' bound by d |w|."""
    ref = (dequantized_activations(x).double() @ w.double().T).float()
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    steps = (blocks / torch.where(d > 0, d, 1)).abs()
    near_half = (steps - steps.floor() - 0.5).abs() < steps * 2.0 ** -21   # 8 float32 ulps of x / d
    slack = ((near_half * d).reshape(x.shape).double() @ w.double().abs().T).float()
    err = (out.float() - ref).abs()
    tol = 1e-5 * ref.abs() + 1e-5 * ref.abs().max() + slack
    assert (err <= tol).all(), f"{(err > tol).sum().item()} outputs off; worst err / tol {(err / tol).max().item():.3g}"


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q2_k", "q6_k", "q5_0", "q3_k"])
def test_gpu_int8_gemv_rows_together_change_no_bit(name):
    """Compiled, at a Llama-shaped K and the default tiles and splits: the rows of x together in a program
    (rows_per_program) give every row the bits it gets in a program of its own, and alone."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 1000, 4096, DEVICE, seed=7)
    rows = quant_gemv_int8.MAX_ROWS
    x = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    outs = []
    for per_program in (1, 2, rows):
        outs.append(torch.empty(rows, 1000, device=DEVICE, dtype=torch.bfloat16))
        quant_gemv_int8.quant_gemv_int8(x, weight, outs[-1], rows_per_program=per_program)
    alone = torch.empty(1, 1000, device=DEVICE, dtype=torch.bfloat16)
    quant_gemv_int8.quant_gemv_int8(x[2:3], weight, alone)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]) and torch.equal(outs[2][2:3], alone)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", HIGH_PLANE_TYPES)
def test_gpu_high_plane_int8_gemv_equals_the_rounded_reference(name):
    """Compiled (prmt, lop3, dp4a), the default tiles and splits at a Llama-shaped K: GGUF blocks with a high plane
    against the GGUF dequantizer's weight times the rounded x, one row and MAX_ROWS together."""
    weight, w = gguf_weight(name, 1000, 4096, seed=3)
    x = torch.randn(quant_gemv_int8.MAX_ROWS, 4096, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    out = torch.full((x.shape[0], 1000), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x, weight, out)
    assert_rounded_reference(out, x, w)
    one = torch.full((1, 1000), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x[1:2], weight, one)
    assert torch.equal(one, out[1:2])


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
    ref = dequantized_activations(x) @ w.T
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
    rounded = dequantized_activations(x[:rows]) @ w.T
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


@pytest.mark.parametrize("name", HIGH_PLANE_TYPES)
@pytest.mark.parametrize("config,n,k,splits", [
    (None, 21, 1024, None),        # the default tiles (the interpreter splits K in 2 at 1024), N not a tile multiple
    ((16, 8, 4), 48, 512, 1),      # every tile in bounds: the unmasked form (EVEN)
    ((16, 8, 4), 13, 768, 3),      # N tail, K in 3 parts
    ((16, 64, 4), 16, 768, 1),     # K tail: the last step's tile is part past the weight (4-bit: 96 words of 64)
])
def test_high_plane_int8_gemv_equals_the_rounded_reference(name, config, n, k, splits):
    """Q6_K, Q5_K, Q5_0, Q5_1 and Q3_K from real GGUF blocks: each element's high bits above its low bits in the
    bytes dp4a takes, against the GGUF dequantizer's weight times the rounded x (so a high bit dropped or taken from
    another element fails), with the tiles' masks and K splits; the T=1 dispatch takes this path."""
    weight, w = gguf_weight(name, n, k, seed=n + k)
    assert quant_gemv_int8.applies(weight.layout, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    x[0, 64:96] = 0.0   # an all-zero block of 32 has scale 0
    out = torch.full((1, n), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x, weight, out, config, splits=splits)
    assert_rounded_reference(out, x, w)
    exact = x @ w.T
    assert ((out - exact).abs().max() / exact.abs().max()).item() < 2e-2
    assert_rounded_reference(quant_matmul(x, weight), x, w)


@pytest.mark.parametrize("name", HIGH_PLANE_TYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_high_plane_rows_together_or_apart_give_the_same_bits(name, splits):
    """1 to MAX_ROWS rows of x with a high plane: every row the same bits whether its program takes 1, 2, ... or all
    of the rows, whatever the number of rows in the call, as alone; K whole or in 3 parts."""
    rows = quant_gemv_int8.MAX_ROWS
    weight, w = gguf_weight(name, 24, 512, seed=5)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(19)).to(DEVICE)
    alone = torch.full((rows, 24), float("nan"), device=DEVICE)
    for i in range(rows):
        quant_gemv_int8.quant_gemv_int8(x[i:i + 1], weight, alone[i:i + 1], splits=splits)
    assert_rounded_reference(alone, x, w)
    for t in range(2, rows + 1):
        for per_program in range(1, t + 1):
            out = torch.full((t, 24), float("nan"), device=DEVICE)
            quant_gemv_int8.quant_gemv_int8(x[:t], weight, out, splits=splits, rows_per_program=per_program)
            assert torch.equal(out, alone[:t]), (t, per_program)


@pytest.mark.parametrize("low,high,scale_group", [(4, 2, 64), (4, 1, 16), (2, 1, 64)])
def test_high_plane_loaded_per_word_where_a_factor_group_is_not_one_high_word(low, high, scale_group):
    """A high-plane word spans 2 (4 + 2 bits, 2 + 1) or 4 (4 + 1) low words; where a factor group holds another
    number of low words (not a GGUF layout but Q3_K, whose 16-element groups are one word), each word loads its own
    high word and picks its part: against the layout's reference, a few rows together and apart."""
    layout = QuantLayout(low, high, scale_group, 256, a_mode=1, b_mode=1, b_const=-8, int8_activations=True)
    weight = random_weight(layout, 20, 768, DEVICE, seed=23)
    w = dequantize_planes(weight).to(DEVICE)
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    together = torch.full((3, 20), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x, weight, together, (16, 8, 4), splits=2, rows_per_program=3)
    assert_rounded_reference(together, x, w)
    apart = torch.full((3, 20), float("nan"), device=DEVICE)
    quant_gemv_int8.quant_gemv_int8(x, weight, apart, (16, 8, 4), splits=2, rows_per_program=1)
    assert torch.equal(together, apart)


def test_int8_activations_cover_high_planes_but_not_fp8_or_the_switch(monkeypatch):
    """The GGUF layouts take the int8 GEMV, high planes too; not a layout without ``int8_activations`` (GPTQ's
    W4A16, FP8), plane widths whose integers do not fit a byte of dp4a or that the kernel does not unpack, nor any
    with CVLLM_QUANT_INT8_ACTIVATIONS=0."""
    on = dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True)
    for name in ("q6_k", "q3_k", "q5_0"):
        assert quant_gemv_int8.applies(dataclasses.replace(LAYOUTS[name], int8_activations=True), 1024)
    assert not quant_gemv_int8.applies(LAYOUTS["q4_k"], 1024)   # not set: GPTQ's W4A16, FP8
    assert not quant_gemv_int8.applies(LAYOUTS["q6_k"], 1024)
    for widths in ((8, 1), (2, 2)):
        assert not quant_gemv_int8.applies(QuantLayout(*widths, 32, 256, int8_activations=True), 1024)
    assert not quant_gemv_int8.applies(on, 1000)   # not whole blocks of 32 inputs
    monkeypatch.setenv(quant_gemv_int8.ENV, "0")
    assert not quant_gemv_int8.applies(on, 1024)
    assert not quant_gemv_int8.applies(dataclasses.replace(LAYOUTS["q6_k"], int8_activations=True), 1024)


def test_high_planes_are_on_by_default_and_can_be_switched_off(monkeypatch):
    q6_k, q4_k = (dataclasses.replace(LAYOUTS[name], int8_activations=True) for name in ("q6_k", "q4_k"))
    monkeypatch.delenv(quant_gemv_int8.HIGH_PLANES_ENV)
    assert quant_gemv_int8.applies(q6_k, 1024) and quant_gemv_int8.applies(q4_k, 1024)
    monkeypatch.setenv(quant_gemv_int8.HIGH_PLANES_ENV, "0")
    assert not quant_gemv_int8.applies(q6_k, 1024)
    assert quant_gemv_int8.applies(q4_k, 1024)


def test_rows_go_together_in_a_program_only_on_a_large_layer():
    """The default: rows together where the weight stream is the cost (a Llama-3-8B layer), a program a row on the
    demo model's small layers (more programs in parallel), one row alone either way."""
    if quant_gemv_int8.ROWS_PER_PROGRAM:
        pytest.skip("CVLLM_GEMV_ROWS_PER_PROGRAM is set")
    assert quant_gemv_int8.program_rows(5, 4096, 4096) == 5
    assert quant_gemv_int8.program_rows(3, 28672, 4096) == 3
    assert quant_gemv_int8.program_rows(5, 960, 576) == 1
    assert quant_gemv_int8.program_rows(1, 4096, 4096) == 1


def test_tuned_tiles_are_keyed_by_the_kernel_that_runs():
    """A GGUF Q4_K weight's tiles tuned for the int8 GEMV are not the float GEMV's (which runs it under
    CVLLM_QUANT_INT8_ACTIVATIONS=0): the tuned table is keyed by the kernel, not by the layout's flag."""
    from cvllm_cuda.kernels.tuned_matmul import TUNED_QUANT_GEMV, quant_gemv_key

    q4_k = dataclasses.replace(LAYOUTS["q4_k"], int8_activations=True)
    h200 = TUNED_QUANT_GEMV["NVIDIA H200"]
    assert quant_gemv_key(4096, 4096, q4_k, True) in h200
    assert quant_gemv_key(4096, 4096, q4_k, False) not in h200


@pytest.mark.parametrize("kernel,name,config,n,k,splits", [
    ("int8", "q4_k", None, 24, 1024, None),          # the default tiles, K in 2 parts
    ("int8", "q4_k", (16, 8, 4), 48, 512, 1),        # every tile in bounds (EVEN)
    ("int8", "q8_0", (16, 8, 4), 13, 768, 3),        # N tail, K in 3 parts
    ("int8", "q2_k", (16, 64, 4), 16, 768, 1),       # K tail: one step, part of it past the weight
    ("int8", "Q6_K", None, 21, 1024, None),          # a high plane a group
    ("int8", "Q3_K", (16, 8, 4), 13, 768, 3),        # a high word a low word
    ("float", "gptq4_g128", None, 24, 1024, None),   # GPTQ's W4A16 GEMV, the default tiles and split
    ("float", "q4_k", (16, 8, 4), 48, 512, 1),
    ("float", "q6_k", (16, 8, 4), 13, 768, 3),       # a high plane; N tail, K in 3 parts
])
def test_the_first_weight_tile_read_before_the_wait_changes_no_bit(monkeypatch, kernel, name, config, n, k, splits):
    """CVLLM_GEMV_EARLY_WEIGHTS (the kernels' EARLY): the first K step's weights read before the PDL wait, the
    step itself after it: every row's output the same bits as without, whatever the tiles, masks and splits, in
    the int8 GEMV (3 rows) and the float one (quant_gemv.py, 1 row)."""
    if name.isupper():
        weight, _ = gguf_weight(name, n, k, seed=23)
    else:
        layout = LAYOUTS[name]
        weight = random_weight(dataclasses.replace(layout, int8_activations=kernel == "int8"), n, k, DEVICE, seed=23)
    rows = 3 if kernel == "int8" else 1
    gemv = quant_gemv_int8.quant_gemv_int8 if kernel == "int8" else quant_gemv.quant_gemv
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(23)).to(DEVICE)
    outs = []
    for early in (False, True):
        monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
        outs.append(torch.full((rows, n), float("nan"), device=DEVICE))
        gemv(x, weight, outs[-1], config, splits=splits)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q6_k", "q3_k"])
def test_gpu_early_weights_change_no_bit(monkeypatch, name):
    """Compiled (with PDL on Hopper), Llama-shaped: CVLLM_GEMV_EARLY_WEIGHTS gives the same bits every launch, each
    right after a kernel that writes x (the wait must still order the reads of x: a race would not repeat), and the
    plain kernel's outputs to within an ulp of bf16 or the float32 sums' rounding (the peeled first step's float
    multiply-adds may be contracted otherwise than the loop's: on the H200 and an H100, Q3_K's differed in
    1-3 of 20,480 outputs by one ulp)."""
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 4096, 4096, DEVICE, seed=29)
    rows = quant_gemv_int8.MAX_ROWS
    source = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(29)).to(DEVICE, torch.bfloat16)
    outs = []
    for early in (False, True):
        monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
        for _ in range(3):
            x = source * 1.0   # written by the kernel just before
            outs.append(torch.empty(rows, 4096, device=DEVICE, dtype=torch.bfloat16))
            quant_gemv_int8.quant_gemv_int8(x, weight, outs[-1])
    assert all(torch.equal(outs[0], out) for out in outs[1:3]), "plain launches differ"
    assert all(torch.equal(outs[3], out) for out in outs[4:]), "launches with the early weights differ"
    plain, early = outs[0].float(), outs[3].float()
    # bf16's ulp (2^-7 of the value at most), and where a row's products cancel to near 0 the float32 sums' own
    # rounding, which scales with the row's terms, not with the small result (2^-16 of the row's largest output)
    ulp = torch.maximum(plain.abs(), early.abs()) * 2.0 ** -7
    floor = plain.abs().amax(dim=1, keepdim=True) * 2.0 ** -16
    assert ((plain - early).abs() <= ulp + floor).all()
    assert (plain != early).sum().item() <= 16
