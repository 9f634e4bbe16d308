"""Sweep the stream-K GEMM's tiles (kernels/stream_k_gemm.py) against cuBLAS for decode batches of 65..256 rows.

    python bench/tune_stream_k.py --json $OUT/tune_stream_k.json --write $OUT/tuned_matmul.py   # on the GPU
    python bench/tune_stream_k.py --tiny                              # CPU rehearsal (Triton's interpreter)

Per row bucket (rows rounded up to a multiple of 64: 128, 192, 256) and Llama-3-8B projection: every
candidate tile at the bucket's top row count, then the best one and cuBLAS at the bucket's lowest row count
too (72, 136, 200: the decode graph ladder's sizes step by 8). An entry is proposed where the best tile beats
cuBLAS by more than 2% at both; the output of the best tile is checked against cuBLAS's. Times as
tune_matmul.py's: CUDA-graph replays cycling through weight copies larger than the L2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402
from tune_matmul import SHAPES, TINY_SHAPES, per_launch_ms, sweep, weight_copies  # noqa: E402

BUCKETS = {128: 72, 192: 136, 256: 200}   # bucket (its top row count): its lowest row count
LLAMA = ("llama qkv", "llama o", "llama gate_up", "llama down", "llama lm_head")


def candidates(tiny: bool):
    from cvllm_cuda.kernels.stream_k_gemm import StreamKTile

    if tiny:
        return [StreamKTile(16, 32, 32, 4, 1)]
    tiles = [(64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
             (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (256, 128, 64, 8, 4)]
    return [StreamKTile(*t) for t in tiles]


def astuple(tile) -> tuple[int, ...]:
    return (tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--buckets", default="128,192,256")
    ap.add_argument("--write", type=Path, help="write tuned_matmul.py here with this GPU's stream-K entries merged in")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    from cvllm_cuda.kernels.stream_k_gemm import stream_k_gemm

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shapes = TINY_SHAPES if args.tiny else {name: SHAPES[name] for name in LLAMA}
    buckets = {32: 24} if args.tiny else {int(b): BUCKETS[int(b)] for b in args.buckets.split(",")}
    result = {"bench": "tune_stream_k", "gpu": "cpu (interpreter)" if args.tiny else torch.cuda.get_device_name(),
              "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": "python " + " ".join(sys.argv), "dtype": str(dtype).removeprefix("torch."), "shapes": {},
              "entries": {}}
    print(f"{'shape':16s} {'rows':>4s} {'cuBLAS us':>10s} {'TFLOP/s':>8s} {'stream-K us':>12s} {'TFLOP/s':>8s} "
          f"{'gain':>6s}  low rows: cuBLAS / stream-K us   best (m, n, k, warps, stages)  max |err|")
    for name, (n, k) in shapes.items():
        weights = weight_copies(n, k, device, dtype)
        for top, low in buckets.items():
            xs = {m: torch.randn(m, k, device=device, dtype=dtype) for m in (top, low)}
            cublas = {m: per_launch_ms(F.linear, x, weights) for m, x in xs.items()}
            timed = sweep(lambda c, x=xs[top], ws=weights:
                          per_launch_ms(lambda a, w: stream_k_gemm(a, w, None, c), x, ws), candidates(args.tiny))
            best = min(timed, key=timed.get)
            low_ms = per_launch_ms(lambda a, w, tile=best: stream_k_gemm(a, w, None, tile), xs[low], weights)
            gain = min(cublas[top] / timed[best], cublas[low] / low_ms)
            reference = F.linear(xs[top], weights[0]).float()
            error = (stream_k_gemm(xs[top], weights[0], None, best).float() - reference).abs().max().item()
            flops = 2 * top * n * k
            print(f"{name:16s} {top:4d} {cublas[top] * 1e3:10.1f} {flops / cublas[top] / 1e9:8.0f} "
                  f"{timed[best] * 1e3:12.1f} {flops / timed[best] / 1e9:8.0f} {gain:6.3f}  "
                  f"{low:3d}: {cublas[low] * 1e3:7.1f} / {low_ms * 1e3:7.1f}   {astuple(best)}  {error:.3g}")
            result["shapes"][f"{name} / {top}"] = {
                "rows": top, "low_rows": low, "out_features": n, "in_features": k,
                "cublas_us": {m: ms * 1e3 for m, ms in cublas.items()}, "best": astuple(best),
                "best_us": {top: timed[best] * 1e3, low: low_ms * 1e3}, "gain_vs_cublas": gain,
                "max_abs_error_vs_cublas": error,
                "top": [(astuple(c), timed[c] * 1e3) for c in sorted(timed, key=timed.get)[:6]]}
            if gain > 1.02:
                result["entries"][repr((top, n, k, result["dtype"]))] = astuple(best)
    print(f"\nentries (bucket, out, in, dtype): tile: {result['entries']}")
    if args.write and not args.tiny:
        from tune_matmul import module_text

        entries = {(top, n, k, result["dtype"]): result["shapes"][f"{name} / {top}"]["best"]
                   for name, (n, k) in shapes.items() for top in buckets
                   if result["shapes"][f"{name} / {top}"]["gain_vs_cublas"] > 1.02}
        swept = {(top, n, k, result["dtype"]) for n, k in shapes.values() for top in buckets}
        provenance = (f"bench/tune_stream_k.py at {result['commit']}, {result['date']} "
                      f"(results/{result['date']}-h200-tune_stream_k-{result['commit']}.json)")
        args.write.write_text(module_text(result["gpu"], {"TUNED_STREAM_K": (entries, swept)}, provenance))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
