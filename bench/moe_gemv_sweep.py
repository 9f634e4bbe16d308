"""Tile sweep of the decode-step MoE kernels (cvllm_cuda/kernels/moe_gemv.py) on the expert shapes of Qwen3-30B-A3B
and DeepSeek-V2-Lite at batch 1, against the grouped GEMM (fused_moe.py's block-per-pair form).

    python bench/moe_gemv_sweep.py --json $OUT/moe_gemv_sweep.json          # on the H200

Each measurement is a CUDA graph of the MoE layer over LAYERS distinct layers' experts (as a decode step runs
them: back to back, PDL on, the weights never in L2), replayed and timed with CUDA events; microseconds a layer and
the routed experts' bytes over that time.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from common import captured_us

from cvllm_cuda.kernels import fused_moe as grouped
from cvllm_cuda.kernels.activation import silu_and_mul
from cvllm_cuda.kernels.moe_gemv import GemvTiles, moe_gemv

SHAPES = {  # hidden, moe intermediate, experts, k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v2-lite": (2048, 1408, 64, 6),
}
LAYERS = 8


def tiles_to_try():
    yield GemvTiles()
    for gn, gk, gw in itertools.product((1, 2, 4), (512, 1024), (2, 4)):
        yield GemvTiles(gate_up_n=gn, gate_up_k=gk, gate_up_warps=gw)
    for dn, dk, dw in itertools.product((1, 2, 4), (128, 256, 512), (2, 4, 8)):
        yield GemvTiles(down_n=dn, down_k=dk, down_warps=dw)


def sweep(name: str, results: list) -> None:
    hidden_size, inter, experts, top_k = SHAPES[name]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = [torch.randn(experts, 2 * inter, hidden_size, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
           for _ in range(LAYERS)]
    w2 = [torch.randn(experts, hidden_size, inter, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(LAYERS)]
    hidden = torch.randn(1, hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
    ids = [torch.randperm(experts, device=dev, generator=gen)[:top_k].view(1, top_k) for _ in range(LAYERS)]
    weights = torch.rand(1, top_k, device=dev, generator=gen)
    routed_bytes = top_k * 3 * inter * hidden_size * 2

    def layers(fn):
        return lambda: [fn(hidden, w13[i], w2[i], weights, ids[i]) for i in range(LAYERS)]

    saved = grouped.PAIR_GEMV_MAX
    grouped.PAIR_GEMV_MAX = 0
    try:
        us = captured_us(layers(lambda *a: grouped.fused_moe(*a, silu_and_mul=silu_and_mul)), LAYERS)
    finally:
        grouped.PAIR_GEMV_MAX = saved
    print(f"{name}: grouped GEMM {us:.1f} us/layer ({routed_bytes / us / 1e6:.2f} TB/s)")
    results.append({"shape": name, "kernel": "grouped", "us": us})
    timed = []
    for tiles in tiles_to_try():
        us = captured_us(layers(lambda *a, t=tiles: moe_gemv(*a, tiles=t)), LAYERS)
        timed.append((us, tiles))
        results.append({"shape": name, "kernel": "gemv", "tiles": repr(tiles), "us": us})
    timed.sort(key=lambda item: item[0])
    for us, tiles in timed[:6]:
        print(f"{name}: {us:6.1f} us/layer ({routed_bytes / us / 1e6:.2f} TB/s)  {tiles}")
    print(f"{name}: default {next(us for us, t in timed if t == GemvTiles()):.1f} us/layer")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for name in args.shapes.split(","):
        sweep(name, results)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
