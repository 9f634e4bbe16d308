"""The CUDA backend's ``F.linear`` (Backend.linear): which kernel a matmul of a 16-bit layer runs.

One token: the Triton GEMV (gemv.py), faster than cuBLAS on every projection measured (tune_matmul.py).
2..64 tokens: the Triton skinny GEMM (skinny_gemm.py) where a sweep on this GPU found it faster than cuBLAS
for that row tile and weight shape (tuned_matmul.TUNED_SKINNY), cuBLAS otherwise. Everything else, fp32,
and layers too small to fill the GPU: cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cvllm_cuda.kernels import gpu
from cvllm_cuda.kernels.gemv import MatmulTile, gemv, tiles
from cvllm_cuda.kernels.skinny_gemm import block_m, skinny_gemm
from cvllm_cuda.kernels.tuned_matmul import TUNED_SKINNY

# Smaller layers stay with cuBLAS: their time is launch latency, and with fewer output features the GEMV's
# programs would not reach every SM.
MIN_OUT_FEATURES = 1024
MAX_SKINNY_ROWS = 64


SKINNY_TILES = tiles(TUNED_SKINNY)


def skinny_config(num_rows: int, weight: torch.Tensor) -> MatmulTile | None:
    """The tuned skinny-GEMM tile for this many rows of this weight on this GPU, or None (use cuBLAS)."""
    n, k = weight.shape
    key = (block_m(num_rows), n, k, str(weight.dtype).removeprefix("torch."))
    return gpu.tuned_entry(SKINNY_TILES, weight.device, key)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if (x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and weight.shape[0] >= MIN_OUT_FEATURES and weight.stride(1) == 1
            and (bias is None or bias.dtype == x.dtype)):
        num_rows = x.numel() // x.shape[-1]
        if num_rows == 1:
            return gemv(x, weight, bias)
        if num_rows <= MAX_SKINNY_ROWS:
            config = skinny_config(num_rows, weight)
            if config is not None:
                return skinny_gemm(x, weight, bias, config)
    return F.linear(x, weight, bias)
