"""Rows of a low-bit weight by index (quant_matmul.dequantize_rows: a quantized token embedding's lookups on the GPU)
against the whole weight dequantized, for every plane width and a high plane; in Triton's interpreter without a GPU,
compiled with one."""

from __future__ import annotations

import pytest
import torch

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from test_quant_matmul import DEVICE, LAYOUTS, needs_gpu, random_weight  # noqa: E402

from cvllm_cuda.kernels.quant_matmul import dequantize_rows, dequantize_weight  # noqa: E402

NAMES = ["q4_k", "q6_k", "q8_0", "q2_k", "gptq4_g128", "fp8_block128"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_the_dequantized_weights_rows(name, dtype):
    weight = random_weight(LAYOUTS[name], 100, 512, DEVICE, seed=4)   # 100 rows: no tile divides them
    ids = torch.tensor([[0, 99, 5], [5, 42, 17]], device=DEVICE)   # repeats, the last row, a 2-D batch
    rows = dequantize_rows(weight, ids, dtype)
    assert rows.shape == (2, 3, 512) and rows.dtype == dtype
    assert torch.equal(rows, dequantize_weight(weight, dtype).t()[ids])


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_gpu_rows_of_a_llama_sized_table(name):
    """Compiled, at a Llama-3-8B table's width and a batch of lookups inside a CUDA graph."""
    weight = random_weight(LAYOUTS[name], 1000, 4096, DEVICE, seed=5)
    ids = torch.randint(0, 1000, (37,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows = dequantize_rows(weight, ids, torch.bfloat16)   # (also compiles it before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = dequantize_rows(weight, ids, torch.bfloat16)
    ids.copy_(ids.flip(0))
    graph.replay()
    want = dequantize_weight(weight, torch.bfloat16).t()
    assert torch.equal(rows, want[ids.flip(0)]) and torch.equal(captured, want[ids])


def test_no_ids_no_rows():
    weight = random_weight(LAYOUTS["q4_k"], 8, 256, DEVICE)
    assert dequantize_rows(weight, torch.empty(0, dtype=torch.long, device=DEVICE), torch.bfloat16).shape == (0, 256)
