"""The K-quant Triton matmuls (cvllm_gguf/kernels/k_blocks.py) against dequantize-then-matmul in float64.

Without a GPU the kernels run in Triton's CPU interpreter (read when a kernel is decorated, so it is set before
the kernels are imported); the shapes are small for it. Weights are random blocks: every byte random (packed
scales, mins, quants) except the f16 d/dmin, random in 1e-4..2e-3 (``make_rows``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # as conftest.py does, before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from cvllm_gguf.dequant import dequantize  # noqa: E402
from cvllm_gguf.kernels import gguf_matmul, has_kernel  # noqa: E402
from cvllm_gguf.kernels.k_blocks import K_TYPES, LAUNCHERS, SUB_BLOCK, gemm  # noqa: E402
from cvllm_gguf.quant_types import GGMLType  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

# (||out - ref|| / ||ref||, max |out - ref| / max |ref|); the GEMM rounds the dequantized weight to x's dtype
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (3e-3, 6e-3), torch.bfloat16: (1.5e-2, 3e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TYPE_IDS = [t.name for t in K_TYPES]


def reference(x: torch.Tensor, qweight: torch.Tensor, qtype: GGMLType, n: int, k: int) -> torch.Tensor:
    w = dequantize(qweight.cpu(), qtype, (n, k)).double()
    return (x.cpu().double() @ w.T).float()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == dtype
    out = out.cpu().float()
    assert torch.isfinite(out).all(), f"{(~torch.isfinite(out)).sum().item()} outputs unwritten or not finite"
    diff = out - ref
    rel = (diff.norm() / ref.norm()).item()
    worst = (diff.abs().max() / ref.abs().max()).item()
    rel_tol, max_tol = TOLERANCES[dtype]
    assert rel < rel_tol and worst < max_tol, f"relative {rel:.3g} (< {rel_tol}), max {worst:.3g} (< {max_tol})"


def run(launcher, qtype: GGMLType, t: int, n: int, k: int, dtype: torch.dtype, make_rows, seed: int,
        device: str = DEVICE) -> None:
    qweight = make_rows(qtype, n, k, seed).to(device)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)
    out = torch.full((t, n), float("nan"), dtype=dtype, device=device)  # every element must be written
    launcher(x, qweight, n, k, out)
    assert_close(out, reference(x, qweight, qtype, n, k), dtype)


@pytest.mark.skipif(not INTERPRET, reason="interpreter shapes; the GPU test covers CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", K_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("t, n, k", [(1, 7, 512), (2, 4, 256), (3, 13, 256), (8, 5, 256)])
def test_gemv_matches_dequantized_matmul(qtype, dtype, t, n, k, make_rows):
    run(LAUNCHERS[qtype][0], qtype, t, n, k, dtype, make_rows, seed=t * 100 + n)


@pytest.mark.skipif(not INTERPRET, reason="interpreter shapes; the GPU test covers CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", K_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("t, n, k", [(17, 37, 512), (33, 70, 256)])
def test_gemm_matches_dequantized_matmul(qtype, dtype, t, n, k, make_rows):
    run(LAUNCHERS[qtype][1], qtype, t, n, k, dtype, make_rows, seed=t * 100 + n)


@pytest.mark.skipif(not INTERPRET, reason="interpreter shapes; the GPU test covers CUDA")
@pytest.mark.parametrize("qtype", K_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("steps", [1, 2, 4, 8], ids=lambda s: f"{s}_steps")
def test_gemm_k_steps(qtype, steps, make_rows):
    """A super-block in 1..8 K steps of the GEMM (8: one sub-block of Q4_K/Q5_K a step, two of the others)."""
    block_k = 256 // steps
    assert block_k % SUB_BLOCK[qtype] == 0
    qweight = make_rows(qtype, 20, 512, steps)
    x = torch.randn(18, 512, generator=torch.Generator().manual_seed(steps))
    out = torch.full((18, 20), float("nan"))
    gemm(qtype, x, qweight, 20, 512, out, tile=(16, 16, block_k, 4))
    assert_close(out, reference(x, qweight, qtype, 20, 512), torch.float32)


@pytest.mark.skipif(not INTERPRET, reason="interpreter shapes; the GPU test covers CUDA")
def test_strided_x_rows_and_registration(make_rows):
    """x and out rows with a stride (a view of a wider tensor); the dispatcher knows every K-quant."""
    assert all(has_kernel(qtype) for qtype in K_TYPES)
    qtype, n, k = GGMLType.Q4_K, 9, 256
    qweight = make_rows(qtype, n, k, 5)
    wide = torch.randn(2, k + 64, generator=torch.Generator().manual_seed(5))
    x = wide[:, 32:32 + k]
    out_wide = torch.full((2, n + 3), float("nan"))
    out = out_wide[:, :n]
    LAUNCHERS[qtype][0](x, qweight, n, k, out)
    assert_close(out, reference(x, qweight, qtype, n, k), torch.float32)
    assert torch.isnan(out_wide[:, n:]).all()  # nothing written past the rows' ends
    assert_close(gguf_matmul(x.contiguous(), qweight, qtype, n, k), reference(x, qweight, qtype, n, k), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU (compiled kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", K_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("t", [1, 4, 8, 9, 100])
def test_gpu_larger_shape(qtype, dtype, t, make_rows):
    n, k = 1000, 2048
    gemv, gemm = LAUNCHERS[qtype]
    run(gemv if t <= 8 else gemm, qtype, t, n, k, dtype, make_rows, seed=t, device="cuda")
