"""The H200's ceilings for a decode step of many rows: read-only and copy bandwidth, and cuBLAS's bf16 matmuls of the
Llama-3-8B projections at 64 and 256 rows (what the engine's GEMMs and attention are compared with).

    python bench/ceilings.py            # on the GPU machine; a few seconds

Timing and weight copies are tune_matmul.py's (CUDA-graph replays, weights cycled over copies larger than the L2),
the copy rate latency.py's. Read-only bandwidth is a full-tensor fp32-accumulated sum of bf16: what a
memory-bound attention kernel can approach.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

sys.path.insert(0, str(Path(__file__).parent))
from latency import copy_bandwidth_tb_s  # noqa: E402
from tune_matmul import SHAPES, per_launch_ms, weight_copies  # noqa: E402


def read_bandwidth_tb_s() -> float:
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)   # 2 GiB: 32-bit indexing, far past the L2
    ms = triton.testing.do_bench_cudagraph(lambda: x.sum(dtype=torch.float32), rep=30, return_mode="median")
    return x.numel() * x.element_size() / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    args = ap.parse_args()
    print(f"read-only (sum) {read_bandwidth_tb_s():.2f} TB/s")
    print(f"copy            {copy_bandwidth_tb_s():.2f} TB/s (read + write)")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            if not name.startswith("llama "):
                continue
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = per_launch_ms(lambda x, w: F.linear(x, w), a, weight_copies(n, k, "cuda", torch.bfloat16))
            print(f"M={m:<4} {name:14s} {ms * 1e3:7.1f} us  {2 * m * n * k / ms / 1e9:5.0f} TFLOP/s  "
                  f"{n * k * 2 / ms / 1e9:5.2f} TB/s of weight")


if __name__ == "__main__":
    main()
