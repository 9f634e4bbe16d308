"""Sweep split-KV decode on this GPU: how many slices to cut each sequence's keys into, and the tile, for the
small decode batches that leave SMs idle (batch 1 above all: 8 KV heads are 8 programs on 132 SMs).

    python bench/tune_split_decode.py --json $OUT/tune_split_decode.json     # on the GPU machine
    python bench/tune_split_decode.py --tiny                                  # CPU rehearsal (interpreter)

A batch-1 decode step runs one attention launch (plus the slices' combine) per layer, back to back with the
rest of the layer inside a CUDA graph, so each candidate is timed the way the engine runs it: one graph of 32
launches, each over its own layer's K/V (together larger than the L2), programmatic dependent launch as
configured (kernels/pdl.py); the time is per launch, combine included. Llama-3-8B heads (32 query, 8 KV),
head_dim 128, bf16, block size 16."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"   # before Triton is imported

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import command_line, git_commit  # noqa: E402

from cvllm_cuda.kernels.paged_attention import (  # noqa: E402
    AttentionConfig,
    attention_config,
    default_num_splits,
    is_sparse_decode,
    paged_attention,
)

BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, LAYERS, DTYPE = 16, 128, 32, 8, 32, torch.bfloat16
WORKLOADS = {"1 x 1k": (1, 1024), "1 x 4k": (1, 4096), "16 x 1k": (16, 1024)}
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def workload(batch: int, context: int, generator: torch.Generator) -> dict:
    blocks = -(-(context + 1) // BLOCK_SIZE)
    pages = torch.randperm(batch * blocks, generator=generator).to(torch.int32).view(batch, blocks)
    cache = (batch * blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    layer_bytes = 2 * math.prod(cache) * DTYPE.itemsize
    layers = max(2, min(LAYERS, math.ceil(3 * 60e6 / layer_bytes)))   # all layers' K/V > 3x the 50 MB L2
    return {"q": torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE),
            "caches": [(torch.randn(cache, device=DEVICE, dtype=DTYPE), torch.randn(cache, device=DEVICE, dtype=DTYPE))
                       for _ in range(layers)],
            "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=DEVICE),
            "seq_lens": torch.full((batch,), context + 1, dtype=torch.int32, device=DEVICE),
            "tables": pages.to(DEVICE), "kv_bytes": batch * (context + 1) * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize}


def time_us(w: dict, splits: int | None, config: AttentionConfig | None) -> float:
    out = torch.empty_like(w["q"])

    def run():
        for k, v in w["caches"]:
            paged_attention(w["q"], k, v, w["query_start_loc"], w["seq_lens"], w["tables"], 1, HEAD_DIM ** -0.5,
                            None, None, out, num_splits=splits, config=config)
    run()   # compiles outside the graph
    if DEVICE == "cpu":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e6 / len(w["caches"])
    import triton

    return triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / len(w["caches"])


def candidates(tiny: bool) -> list[tuple[int, AttentionConfig]]:
    if tiny:
        return [(1, AttentionConfig(16, 32, 2, 2)), (4, AttentionConfig(16, 32, 2, 2))]
    tiles = [AttentionConfig(16, n, w, s) for n, w, s in itertools.product((32, 64, 128), (2, 4), (2, 3))]
    return [(splits, tile) for splits in (1, 2, 4, 8, 16) for tile in tiles]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: Triton's interpreter, one short workload")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    workloads = {"1 x 100": (1, 100)} if args.tiny else WORKLOADS
    named = {name: workload(batch, context, g) for name, (batch, context) in workloads.items()}
    device = torch.device(DEVICE)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)"
    result = {"bench": "tune_split_decode", "gpu": gpu, "commit": git_commit(),
              "date": datetime.date.today().isoformat(), "command": command_line(), "workloads": {}}
    for name, w in named.items():
        batch = w["q"].shape[0]
        default_splits = default_num_splits(batch, KV_HEADS, 1, device)
        # what paged_attention launches without overrides (the sparse-decode tile where one is committed)
        default_tile = attention_config(HEAD_DIM, DTYPE, True, device,
                                        is_sparse_decode(batch, KV_HEADS, default_splits, device))
        base = time_us(w, None, None)
        timed = {}
        for splits, tile in candidates(args.tiny):
            try:
                timed[(splits, tile)] = time_us(w, splits, tile)
            except Exception as e:   # a tile the compiler rejects: not a candidate
                print(f"  skip {splits} {astuple(tile)}: {type(e).__name__}", file=sys.stderr)
        ranked = sorted(timed, key=timed.get)
        best_per_split = {s: min((t for t in timed if t[0] == s), key=timed.get) for s in {s for s, _ in timed}}
        print(f"\n{name}: default {default_splits} splits x {astuple(default_tile)} {base:6.2f} us "
              f"({w['kv_bytes'] / base / 1e6:4.2f} TB/s)")
        for s in sorted(best_per_split):
            key = best_per_split[s]
            print(f"  {s:2d} splits, best tile {str(astuple(key[1])):18s} {timed[key]:6.2f} us "
                  f"({w['kv_bytes'] / timed[key] / 1e6:4.2f} TB/s)")
        result["workloads"][name] = {
            "kv_bytes": w["kv_bytes"], "default_splits": default_splits, "default_tile": astuple(default_tile),
            "default_us": base,
            "best": [ranked[0][0], astuple(ranked[0][1])], "best_us": timed[ranked[0]],
            "best_per_split": {s: [astuple(k[1]), timed[k]] for s, k in sorted(best_per_split.items())},
            "top": [[s, astuple(t), timed[(s, t)]] for s, t in ranked[:10]]}
        del w["caches"]
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def astuple(config: AttentionConfig) -> tuple[int, int, int, int]:
    return (config.block_m, config.block_n, config.num_warps, config.num_stages)


if __name__ == "__main__":
    main()
