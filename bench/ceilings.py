"""The H200's ceilings for a decode step of many rows: read-only and copy bandwidth, and cuBLAS's bf16 matmuls of the
Llama-3-8B projections at 64 and 256 rows (what the engine's GEMMs and attention are compared with).

    python bench/ceilings.py            # on the GPU machine; a few seconds

Each figure is the median of CUDA-graph replays of 10 back-to-back launches, weights cycled over copies larger
than the L2. Read-only bandwidth is a full-tensor fp32-accumulated sum of bf16 (what a memory-bound attention
kernel can approach); the copy counts bytes read + written.
"""

from __future__ import annotations

import argparse
import statistics

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def graph_ms(fn, replays: int = 30) -> float:
    """Milliseconds of one ``fn()`` call: a graph of 10 calls, replayed, median over replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 10)
    return statistics.median(times)


def bandwidth_tb_s() -> tuple[float, float]:
    """(read-only, copy) TB/s over a 2 GiB bf16 tensor (32-bit indexing, far past the L2)."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    return nbytes / graph_ms(lambda: x.sum(dtype=torch.float32)) / 1e9, 2 * nbytes / graph_ms(lambda: y.copy_(x)) / 1e9


def matmul_ms(m: int, n: int, k: int) -> float:
    """cuBLAS's ``F.linear`` of m rows by an n x k bf16 weight, cycling over weight copies past the L2."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, int(2e9 // (n * k * 2))))]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    turn = [0]

    def matmul():
        turn[0] = (turn[0] + 1) % len(weights)
        return torch.nn.functional.linear(a, weights[turn[0]])

    return graph_ms(matmul)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,256")
    args = ap.parse_args()
    read, copy = bandwidth_tb_s()
    print(f"read-only (sum) {read:.2f} TB/s")
    print(f"copy            {copy:.2f} TB/s (read + write)")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in SHAPES.items():
            ms = matmul_ms(m, n, k)
            print(f"M={m:<4} {name:8s} {ms * 1e3:7.1f} us  {2 * m * n * k / ms / 1e9:5.0f} TFLOP/s  "
                  f"{n * k * 2 / ms / 1e9:5.2f} TB/s of weight")


if __name__ == "__main__":
    main()
