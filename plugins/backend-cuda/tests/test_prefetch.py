"""CVLLM_GEMV_PREFETCH (kernels/prefetch.py): L2 prefetches are hints, so the GEMVs that issue them give the same bits
with them as without, whatever the tails and splits; on a GPU this also runs the clamped addresses at every plane's
edges (a prefetch past an allocation is not defined to be harmless). In the interpreter they are skipped, and the
arithmetic around them still runs."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_gemv_int8 import gguf_weight  # noqa: E402
from test_quant_gemv_mma import MMA_LAYOUTS, needs_device  # noqa: E402
from test_quant_matmul import DEVICE, LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels import prefetch, quant_gemv_int8, quant_gemv_mma, quant_tiles  # noqa: E402


@needs_device
@pytest.mark.parametrize("name,n,k,splits,early", [
    ("q4_k", 48, 1024, 3, False),     # K in parts that end inside the prefetched tiles
    ("q4_k", 20, 512, 1, True),       # a feature tail; the tiles past the one read early
    ("Q6_K", 21, 768, 2, False),      # a high plane a group
    ("Q3_K", 20, 768, 1, True),       # a high word a low word
    ("q8_0", 13, 256, 1, False),      # fewer words than one prefetch asks for
])
def test_the_int8_gemv_gives_the_same_bits_with_prefetches(monkeypatch, name, n, k, splits, early):
    if name.isupper():
        weight, _ = gguf_weight(name, n, k, seed=41)
    else:
        weight = random_weight(dataclasses.replace(LAYOUTS[name], int8_activations=True), n, k, DEVICE, seed=41)
    monkeypatch.setattr(quant_tiles, "EARLY_WEIGHTS", early)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    outs = []
    for tiles in (0, 4):
        monkeypatch.setattr(prefetch, "PREFETCH_TILES", tiles)
        outs.append(torch.full((3, n), float("nan"), device=DEVICE))
        quant_gemv_int8.quant_gemv_int8(x, weight, outs[-1], (16, 8, 4), splits=splits)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


@needs_device
@pytest.mark.parametrize("name,rows,n,k,splits", [
    ("gptq4_g128", 1, 72, 1024, 3), ("gptq4_g32", 9, 40, 512, 1), ("q4_k", 4, 256, 256, 1)])
def test_the_mma_gemv_gives_the_same_bits_with_prefetches(monkeypatch, name, rows, n, k, splits):
    weight = random_weight(MMA_LAYOUTS[name], n, k, DEVICE, seed=43)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(43)).to(torch.bfloat16).to(DEVICE)
    outs = []
    for tiles in (0, 4):
        monkeypatch.setattr(prefetch, "PREFETCH_TILES", tiles)
        outs.append(torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=DEVICE))
        quant_gemv_mma.quant_gemv_mma(x, weight, outs[-1], splits=splits)
    assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])


def test_the_switch_takes_powers_of_two_only():
    run = subprocess.run([sys.executable, "-c", "import cvllm_cuda.kernels.prefetch"], capture_output=True, text=True,
                         env={**os.environ, "CVLLM_GEMV_PREFETCH": "3"})
    assert run.returncode != 0 and "power of two" in run.stderr
