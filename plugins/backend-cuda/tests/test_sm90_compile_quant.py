"""The low-bit GEMMs and GEMVs compiled for Hopper on CPU (sm90.py; run with the rest by test_sm90_compile.py's
test_kernels_compile_for_hopper, the interpreter off): the swapped GEMM's inline PTX and operand lanes, the int8
GEMV's rows, and bench/sass_stats.py's specs."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

import sm90  # noqa: E402
from test_sm90_compile import compiled_launches, compiles  # noqa: E402

quant_gemm_swapped = importlib.import_module("cvllm_cuda.kernels.quant_gemm_swapped")   # (the function has its name)


@compiles
@pytest.mark.parametrize("name", ["q4_k", "gptq4_g128", "q6_k", "q8_0", "q2_k", "q3_k", "fp8_block128"])
@pytest.mark.parametrize("rows", [2, 128])   # (lanes: 4-bit without a high plane; the rest position by position)
def test_swapped_low_bit_gemm_compiles(monkeypatch, name, rows):
    """Every plane width's default tile compiles and fits the H200's shared memory at the smallest and largest row
    tiles."""
    from test_quant_matmul import LAYOUTS, random_weight
    weight = random_weight(LAYOUTS[name], 256, 1024, "cpu")
    x = torch.zeros(rows, 1024, dtype=torch.bfloat16)
    out = torch.empty(rows, 256, dtype=torch.bfloat16)
    assert len(compiled_launches(monkeypatch, quant_gemm_swapped, "_gemm_swapped_kernel",
                                 lambda: quant_gemm_swapped.quant_gemm_swapped(x, weight, out, splits=1))) == 1


@compiles
@pytest.mark.parametrize("name", ["q4_k", "gptq4_g128"])
@pytest.mark.parametrize("rows", [2, 64])
def test_swapped_gemm_operand_lanes_skip_the_unpacked_tiles_round_trip(monkeypatch, name, rows):
    """CVLLM_SWAPPED_OPERAND_LANES: each thread unpacks the lanes its wgmma operand registers hold, so the unpacked
    tile no longer goes through shared memory (four 16-byte stores a K step fewer), and every load is still an
    asynchronous copy of the software pipeline (a synchronous load in the loop cost 30-40% on the H200, session 23)."""
    from test_quant_matmul import LAYOUTS, random_weight
    weight = random_weight(LAYOUTS[name], 256, 1024, "cpu")
    x, out = torch.zeros(rows, 1024, dtype=torch.bfloat16), torch.empty(rows, 256, dtype=torch.bfloat16)
    ptx = {}
    for operand_lanes in (False, True):
        with monkeypatch.context() as patch:
            patch.setattr(quant_gemm_swapped, "OPERAND_LANES", operand_lanes)
            kernel, = compiled_launches(patch, quant_gemm_swapped, "_gemm_swapped_kernel",
                                        lambda: quant_gemm_swapped.quant_gemm_swapped(x, weight, out, splits=1))
        ptx[operand_lanes] = kernel.asm["ptx"]
        assert sm90.resource_usage(kernel)["STACK"] == 0, "spilled to local memory"
    assert ptx[True].count("st.shared") == ptx[False].count("st.shared") - 4
    assert "ld.global" not in ptx[True].replace("ld.global.cg", "")
    assert ptx[True].count("cp.async") == ptx[False].count("cp.async")


@compiles
@pytest.mark.parametrize("name", ["q4_k", "q8_0", "q2_k", "q6_k", "q5_0", "q3_k"])
def test_int8_gemv_of_several_rows_compiles_without_spills(monkeypatch, name):
    """The int8 GEMV with MAX_ROWS rows of x in a program (one accumulator a row, kept in registers) at its default
    tiles: compiled for sm_90 with no local-memory traffic (spilled accumulators would cost more than the weight
    reads they share)."""
    from test_quant_matmul import LAYOUTS, random_weight
    quant_gemv_int8 = importlib.import_module("cvllm_cuda.kernels.quant_gemv_int8")
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 256, 1024, "cpu")
    int8_activations = importlib.import_module("cvllm_cuda.kernels.int8_activations")
    monkeypatch.setattr(int8_activations, "_quantize_kernel", sm90.LaunchRecorder(int8_activations._quantize_kernel))
    rows = quant_gemv_int8.MAX_ROWS
    x, out = torch.zeros(rows, 1024, dtype=torch.bfloat16), torch.empty(rows, 256, dtype=torch.bfloat16)
    kernels = compiled_launches(monkeypatch, quant_gemv_int8, "_gemv_int8_kernel",
                                lambda: quant_gemv_int8.quant_gemv_int8(x, weight, out, splits=1))
    assert len(kernels) == 1
    assert sm90.resource_usage(kernels[0])["STACK"] == 0, "spilled to local memory"


@compiles
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0"])
@pytest.mark.parametrize("lookups", [1, 3, 300])
def test_dequantize_rows_compiles(monkeypatch, name, lookups):
    """A quantized embedding's lookups (quant_matmul.dequantize_rows) at a Llama-3-8B table's width, in bf16: one
    row (a decode step), a few, a prefill chunk's."""
    from test_quant_matmul import LAYOUTS, random_weight
    quant_matmul = importlib.import_module("cvllm_cuda.kernels.quant_matmul")
    weight = random_weight(LAYOUTS[name], 256, 4096, "cpu")
    ids = torch.zeros(lookups, dtype=torch.long)
    lookup = lambda: quant_matmul.dequantize_rows(weight, ids, torch.bfloat16)  # noqa: E731
    assert len(compiled_launches(monkeypatch, quant_matmul, "_dequantize_kernel", lookup)) == 1


@compiles
@pytest.mark.parametrize("kind,layout,config,rows", [
    ("int8-gemv", "q4_k", (32, 64, 4, 3), 1), ("float-gemv", "gptq4_g128", (32, 32, 4, 3), 1),
    ("gemm", "q6_k", (128, 8, 4, 4), 64), ("gemm-swapped", "q4_k", (64, 8, 4, 4), 64)])
def test_sass_stats_compiles_every_kind(kind, layout, config, rows):
    """bench/sass_stats.py's specs keep up with the kernels' parameters (a parameter added to a kernel broke two of
    them unnoticed in session 31)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "bench"))
    sass_stats = importlib.import_module("sass_stats")
    stages = config[3] if kind.startswith("gemm") else None
    kernel = sass_stats.compile_sm90(*sass_stats.kernel_spec(kind, sass_stats.LAYOUTS[layout], config, rows), stages)
    assert sm90.registers(kernel) > 0


def compiled_with_and_without_early_weights(monkeypatch, module, name: str, launch) -> dict:
    """{early: the kernel ``module.name`` compiled for sm_90 by ``launch``} with the early weights off, then on (no
    spills either way)."""
    quant_tiles = importlib.import_module("cvllm_cuda.kernels.quant_tiles")
    kernel_fn, kernels = getattr(module, name), {}
    for early in (False, True):
        monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
        monkeypatch.setattr(module, name, kernel_fn)   # (not the last loop's recorder)
        [kernels[early]] = compiled_launches(monkeypatch, module, name, launch)
        assert sm90.resource_usage(kernels[early])["STACK"] == 0, "spilled to local memory"
    return kernels


@compiles
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0", "q3_k"])
def test_early_weights_are_read_before_the_pdl_wait(monkeypatch, name):
    """CVLLM_GEMV_EARLY_WEIGHTS: with PDL the int8 GEMV's first weight loads come before ``griddepcontrol.wait``
    (SASS ACQBULK); without it no load precedes the wait. MAX_ROWS rows, no spills. (x's reads come after the wait
    in the source; which of the SASS loads are x's is not told apart here.)"""
    from test_quant_matmul import LAYOUTS, random_weight
    quant_gemv_int8 = importlib.import_module("cvllm_cuda.kernels.quant_gemv_int8")
    int8_activations = importlib.import_module("cvllm_cuda.kernels.int8_activations")
    monkeypatch.setattr(int8_activations, "_quantize_kernel", sm90.LaunchRecorder(int8_activations._quantize_kernel))
    monkeypatch.setattr(quant_gemv_int8, "pdl_options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
    weight = random_weight(layout, 4096, 4096, "cpu")
    rows = quant_gemv_int8.MAX_ROWS
    x, out = torch.zeros(rows, 4096, dtype=torch.bfloat16), torch.empty(rows, 4096, dtype=torch.bfloat16)
    kernels = compiled_with_and_without_early_weights(monkeypatch, quant_gemv_int8, "_gemv_int8_kernel",
                                                      lambda: quant_gemv_int8.quant_gemv_int8(x, weight, out, splits=1))
    loads_before_wait = {early: sm90.loads_before_wait(kernel) for early, kernel in kernels.items()}
    assert loads_before_wait[False] == 0
    assert loads_before_wait[True] >= 2   # the tile's words and its factors


@compiles
@pytest.mark.parametrize("name", ["gptq4_g128", "q6_k"])
def test_the_float_gemvs_early_weights_are_read_before_the_pdl_wait(monkeypatch, name):
    """The float-activation GEMV (GPTQ's W4A16) with CVLLM_GEMV_EARLY_WEIGHTS: weight loads before ACQBULK, none
    without."""
    from test_quant_matmul import LAYOUTS, random_weight
    quant_gemv = importlib.import_module("cvllm_cuda.kernels.quant_gemv")
    monkeypatch.setattr(quant_gemv, "pdl_options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    weight = random_weight(LAYOUTS[name], 4096, 4096, "cpu")
    x, out = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.empty(1, 4096, dtype=torch.bfloat16)
    kernels = compiled_with_and_without_early_weights(monkeypatch, quant_gemv, "_gemv_kernel",
                                                      lambda: quant_gemv.quant_gemv(x, weight, out, splits=1))
    loads_before_wait = {early: sm90.loads_before_wait(kernel) for early, kernel in kernels.items()}
    assert loads_before_wait[False] == 0 and loads_before_wait[True] >= 2


@compiles
@pytest.mark.parametrize("fp8", [False, True])
def test_the_16_bit_and_fp8_gemvs_early_weights_are_read_before_the_pdl_wait(monkeypatch, fp8):
    """kernels/gemv.py (bf16 rows; FP8 rows with their scales: --isq fp8) with CVLLM_GEMV_EARLY_WEIGHTS: the first
    weight tile's loads before ACQBULK, none without. Either way nothing is loaded after the K loop's last weights
    (the FP8 rows' scales had been: one more round trip at the end of every program)."""
    gemv = importlib.import_module("cvllm_cuda.kernels.gemv")
    monkeypatch.setattr(gemv.pdl, "options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    weight = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scale = torch.ones(4096) if fp8 else None
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    kernels = compiled_with_and_without_early_weights(monkeypatch, gemv, "_gemv_kernel",
                                                      lambda: gemv.gemv(x, weight, scale=scale))
    loads_before_wait = {early: sm90.loads_before_wait(kernel) for early, kernel in kernels.items()}
    assert loads_before_wait[False] == 0 and loads_before_wait[True] >= 1 + fp8
    for kernel in kernels.values():
        lines = sm90.unpredicated(kernel)
        last_weights = max(i for i, line in enumerate(lines) if line.startswith("LDG") and ".EF" in line)
        assert not any(line.startswith("LDG") for line in lines[last_weights + 1:])


@compiles
@pytest.mark.parametrize("rows", [1, 8, 16])
def test_the_mma_gemvs_early_weights_are_read_before_the_pdl_wait(monkeypatch, rows):
    """The MMA GEMV with CVLLM_GEMV_EARLY_WEIGHTS: its first K step's word and factor loads before ACQBULK, none
    without; either way no spills and no layout conversion (its tensors stay one row a lane)."""
    from test_quant_gemv_mma import MMA_LAYOUTS
    from test_quant_matmul import random_weight
    quant_gemv_mma = importlib.import_module("cvllm_cuda.kernels.quant_gemv_mma")
    monkeypatch.setattr(quant_gemv_mma, "pdl_options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 4096, 4096, "cpu")
    x, out = torch.zeros(rows, 4096, dtype=torch.bfloat16), torch.empty(rows, 4096, dtype=torch.bfloat16)
    kernels = compiled_with_and_without_early_weights(monkeypatch, quant_gemv_mma, "_gemv_mma_kernel",
                                                      lambda: quant_gemv_mma.quant_gemv_mma(x, weight, out, splits=1))
    assert not any("convert_layout" in kernel.asm["ttgir"] for kernel in kernels.values())
    loads_before_wait = {early: sm90.loads_before_wait(kernel) for early, kernel in kernels.items()}
    assert loads_before_wait[False] == 0
    assert loads_before_wait[True] >= 4   # a K step's words (16-byte loads) and its scales and zeros


@compiles
@pytest.mark.parametrize("name,rows,n", [("gptq4_g128", 1, 512), ("gptq4_g128", 8, 512), ("gptq4_g128", 16, 512),
                                         ("q4_k", 1, 512), ("q4_1", 3, 512), ("gptq4_g128", 12, 1002)])
def test_mma_gemv_keeps_one_element_a_lane(monkeypatch, name, rows, n):
    """quant_gemv_mma's MMAs read each lane's registers as their fragments: every tensor of the kernel must keep its
    rows (dimension 0) one a thread in lane order, a row's registers in its thread (Triton's 1-D layout, and the
    16-byte loads' [rows, 4]), with no layout conversion, also where the plane's rows are not 16-byte aligned (N 1002:
    then the word loads are narrower, the layout the same); its loop holds the MMAs and no spills."""
    from test_quant_gemv_mma import MMA_LAYOUTS
    from test_quant_matmul import random_weight
    quant_gemv_mma = importlib.import_module("cvllm_cuda.kernels.quant_gemv_mma")
    # (the loop alone: the early weights' peeled first step repeats its MMAs; the test below compiles it)
    monkeypatch.setattr(importlib.import_module("cvllm_cuda.kernels.quant_tiles"), "EARLY_WEIGHTS", False)
    weight = random_weight(MMA_LAYOUTS[name], n, 1024, "cpu")
    x, out = torch.zeros(rows, 1024, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
    [kernel] = compiled_launches(monkeypatch, quant_gemv_mma, "_gemv_mma_kernel",
                                 lambda: quant_gemv_mma.quant_gemv_mma(x, weight, out, splits=1))
    ttgir = kernel.asm["ttgir"]
    words, warps, _ = quant_gemv_mma.tile(rows)
    layouts = re.findall(r"#ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                         r"warpsPerCTA = \[([\d, ]+)\]", ttgir)
    assert layouts
    for per_thread, threads, warps_per_cta in layouts:   # rows in lane order, a row's registers in its thread
        rank = len(threads.split(","))
        assert threads == ", ".join(["32"] + ["1"] * (rank - 1)), threads
        assert warps_per_cta == ", ".join([str(warps)] + ["1"] * (rank - 1)), warps_per_cta
        assert per_thread.startswith("1"), per_thread
    assert "convert_layout" not in ttgir and "elementwise_inline_asm" in ttgir
    assert sm90.resource_usage(kernel)["STACK"] == 0, "spilled to local memory"
    groups = -(-rows // 8)   # MMAs a unit: two a block of two features a lane row and token group, two for X
    assert sum("HMMA.16816.F32.BF16" in line for line in sm90.sass(kernel)) == (
        (words + 2) * groups * quant_gemv_mma.group_units(weight.layout))


@compiles
@pytest.mark.parametrize("rows", [1, 8])
def test_the_mma_gemvs_prefetch_loads_the_next_step_ahead(monkeypatch, rows):
    """CVLLM_GEMV_MMA_PREFETCH: the loop loads the next K step's words as 16-byte loads predicated on there being a
    next step (beside x's, predicated on its rows); with the early weights and without, no spills, and registers that
    let the prefetching tile's warps an SM run at once."""
    from test_quant_gemv_mma import MMA_LAYOUTS
    from test_quant_matmul import random_weight
    quant_gemv_mma = importlib.import_module("cvllm_cuda.kernels.quant_gemv_mma")
    monkeypatch.setattr(quant_gemv_mma, "pdl_options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 4096, 4096, "cpu")
    x, out = torch.zeros(rows, 4096, dtype=torch.bfloat16), torch.empty(rows, 4096, dtype=torch.bfloat16)
    monkeypatch.setattr(quant_gemv_mma, "PREFETCH", True)
    words, warps, per_sm = quant_gemv_mma.tile(rows)
    predicated, kernel_fn = {}, quant_gemv_mma._gemv_mma_kernel
    for prefetch in (False, True):
        monkeypatch.setattr(quant_gemv_mma, "PREFETCH", prefetch)
        monkeypatch.setattr(quant_gemv_mma, "_gemv_mma_kernel", kernel_fn)   # (not the last loop's recorder)
        kernels = compiled_with_and_without_early_weights(
            monkeypatch, quant_gemv_mma, "_gemv_mma_kernel",
            lambda: quant_gemv_mma.quant_gemv_mma(x, weight, out, warps=warps, splits=1))
        predicated[prefetch] = sum(bool(re.match(r"@!?P\d LDG\.E\.128", line)) for line in sm90.sass(kernels[True]))
        for kernel in kernels.values():
            usage = sm90.resource_usage(kernel)
            assert usage["LOCAL"] == 0 and -(-usage["REG"] // 8) * 8 * 32 * per_sm <= 65536, usage
    units = quant_gemv_mma.group_units(weight.layout)
    # x's 16-byte loads (a unit's, predicated on its rows): in the peeled first step and the loop without PREFETCH,
    # in the loop with it; the words' only with it
    assert predicated[False] == 2 * units, predicated
    assert predicated[True] >= units + units * words // 4, predicated


@compiles
@pytest.mark.parametrize("prefetch", [False, True])
def test_the_mma_gemvs_fused_sums_compile(monkeypatch, prefetch):
    """CVLLM_IN_LAUNCH_SPLIT_SUMS: a launch takes its ticket (one atomic add at GPU scope) and puts it back (one
    exchange), and reads the partials back through L2 (strong loads at GPU scope); with and without the early weights
    and PREFETCH no spills, and with the early weights as many warps an SM as the plain kernel (or its tile asks
    for), also at 32 splits (the sums' loads a chunk at a time: unrolled whole they had taken 172 registers)."""
    from test_quant_gemv_mma import MMA_LAYOUTS
    from test_quant_matmul import random_weight
    quant_gemv_mma = importlib.import_module("cvllm_cuda.kernels.quant_gemv_mma")
    monkeypatch.setattr(quant_gemv_mma, "pdl_options", lambda device: {"USE_PDL": True, "launch_pdl": True})
    monkeypatch.setattr(quant_gemv_mma, "add_splits", lambda *args: None)   # (sum_splits_kernel is not compiled here)
    weight = random_weight(MMA_LAYOUTS["gptq4_g128"], 4096, 4096, "cpu")
    x, out = torch.zeros(1, 4096, dtype=torch.bfloat16), torch.empty(1, 4096, dtype=torch.bfloat16)
    kernel_fn, kernels = quant_gemv_mma._gemv_mma_kernel, {}
    for fused in (False, True):
        monkeypatch.setattr(quant_gemv_mma, "_gemv_mma_kernel", kernel_fn)   # (not the last loop's recorder)
        kernels[fused] = compiled_with_and_without_early_weights(
            monkeypatch, quant_gemv_mma, "_gemv_mma_kernel",
            functools.partial(quant_gemv_mma.quant_gemv_mma, x, weight, out, splits=32, prefetch=prefetch,
                              fused_sums=fused))
    def warps_that_fit(kernel) -> int:   # an SM's 64K registers, a thread's rounded up to 8
        return 65536 // (-(-sm90.registers(kernel) // 8) * 8 * 32)

    # with the early weights (the default): without them the 1-row tile aims at 32 warps an SM, and at T = 1 the
    # plain kernel compiles to 62 registers, the summing one to 72 (28 warps)
    monkeypatch.setattr(importlib.import_module("cvllm_cuda.kernels.quant_tiles"), "EARLY_WEIGHTS", True)
    per_sm = quant_gemv_mma.tile(1)[2]
    plain_fit, fused_fit = warps_that_fit(kernels[False][True]), warps_that_fit(kernels[True][True])
    assert fused_fit >= min(plain_fit, per_sm), (plain_fit, fused_fit, per_sm)
    for early in (False, True):
        for fused in (False, True):
            lines = sm90.sass(kernels[fused][early])
            atomics = [line for line in lines if "ATOMG" in line]
            strong = [line for line in lines if re.search(r"LDG\.E(\.\d+)?\.STRONG\.GPU", line)]
            if fused:
                assert len(atomics) == 2 and "ADD.STRONG.GPU" in atomics[0] and "EXCH" in atomics[1], atomics
                assert len(strong) >= 4
            else:
                assert not atomics and not strong


@compiles
@pytest.mark.parametrize("name", ["q4_k", "gptq4_g128", "q6_k"])
def test_the_swapped_gemms_fused_sums_compile(monkeypatch, name):
    """CVLLM_IN_LAUNCH_SPLIT_SUMS in the swapped GEMM at 64 rows: a ticket (one atomic add at GPU scope) and its reset,
    the partials read back through L2; no spills; none of it without the switch, nor for the layouts unpacked
    position by position (Q6_K's tile is at 244 registers: the sum would spill)."""
    from test_quant_matmul import LAYOUTS, random_weight
    monkeypatch.setattr(quant_gemm_swapped, "add_splits", lambda *args: None)   # (sum_splits_kernel not compiled here)
    weight = random_weight(LAYOUTS[name], 256, 4096, "cpu")
    x, out = torch.zeros(64, 4096, dtype=torch.bfloat16), torch.empty(64, 256, dtype=torch.bfloat16)
    kernel_fn = quant_gemm_swapped._gemm_swapped_kernel
    for fused in (False, True):
        monkeypatch.setattr(quant_gemm_swapped, "_gemm_swapped_kernel", kernel_fn)   # (not the last loop's recorder)
        [kernel] = compiled_launches(monkeypatch, quant_gemm_swapped, "_gemm_swapped_kernel",
                                     functools.partial(quant_gemm_swapped.quant_gemm_swapped, x, weight, out,
                                                       splits=9, fused_sums=fused))
        assert sm90.resource_usage(kernel)["STACK"] == 0, "spilled to local memory"
        lines = sm90.sass(kernel)
        atomics = [line for line in lines if "ATOMG" in line]
        in_launch = fused and quant_gemm_swapped.in_lanes(weight.layout, x.dtype)
        assert len(atomics) == (2 if in_launch else 0), atomics
        assert any(re.search(r"LDG\.E(\.\d+)?\.STRONG\.GPU", line) for line in lines) == in_launch
