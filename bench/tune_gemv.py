"""Sweep the one-token GEMV's tiles (plugins/backend-cuda/src/cvllm_cuda/kernels/gemv.py) on this GPU against
cuBLAS, and time the whole batch-1 matmul chain of a Llama-3-8B shape both ways.

    python bench/tune_gemv.py --json $OUT/tune_gemv.json --write $OUT/tuned_gemv.py   # on the GPU machine
    python bench/tune_gemv.py --tiny                                                    # CPU rehearsal

Shapes are the bf16 layers a decode step runs at batch 1: Llama-3-8B's qkv, o, gate_up, down and lm_head,
Qwen3-0.6B's four projections. Each time is the median over CUDA-graph replays that cycle through weight
copies larger than the L2 (a 33 MB o_proj would otherwise be read from cache), reported as the weight
bytes streamed per second. The chain is every projection of the 32 layers plus the lm_head, each layer
with its own weights (15 GB), in one graph: the matmul-only ceiling of batch-1 decode (PERF.md quotes
cuBLAS's: 241 tok/s), timed with programmatic dependent launch (kernels/pdl.py) on and off. A tile is
committed for a shape only where it beats the default by more than 2%."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

SHAPES = {  # name: (out_features, in_features)
    "llama qkv": (6144, 4096), "llama o": (4096, 4096), "llama gate_up": (28672, 4096),
    "llama down": (4096, 14336), "llama lm_head": (128256, 4096),
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048), "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072),
}
TINY_SHAPES = {"tiny a": (64, 128), "tiny b": (96, 256)}
L2_BYTES = 60e6  # the H200's 50 MB L2, rounded up


def candidates(tiny: bool):
    from cvllm_cuda.kernels.gemv import GemvConfig

    if tiny:
        return [GemvConfig(16, 32, 2, 1), GemvConfig(32, 64, 4, 1)]
    tiles = [(1, 2048), (2, 1024), (2, 2048), (4, 512), (4, 1024), (4, 2048), (8, 256), (8, 512), (8, 1024),
             (16, 256), (16, 512)]
    return [GemvConfig(n, k, w, s) for n, k in tiles for w in (1, 2, 4, 8) for s in (1, 3)
            if n * k // (32 * w) <= 256]   # fp32 accumulator elements per thread: more would spill


def time_ms(fn, calls: int) -> float:
    """GPU time of one of ``calls`` launches in ``fn``: CUDA-graph replays (plain launches would time the host)."""
    fn()  # compiles outside the graph
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3 / calls
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") / calls


def shape_workload(n: int, k: int, device: str, dtype: torch.dtype) -> dict:
    nbytes = n * k * dtype.itemsize
    copies = max(2, math.ceil(3 * L2_BYTES / nbytes)) if device == "cuda" else 1
    weights = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for _ in range(copies)]
    return {"x": torch.randn(1, k, device=device, dtype=dtype), "weights": weights, "bytes": nbytes}


def chain_ms(layers: int, device: str, dtype: torch.dtype, use_gemv: bool, configs: dict) -> float:
    """One token through every projection of a Llama-3-8B shape, each layer its own weights: ms per token."""
    from cvllm_cuda.kernels.gemv import gemv

    shapes = [SHAPES[f"llama {p}"] for p in ("qkv", "o", "gate_up", "down")]
    weights = [[torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5 for n, k in shapes] for _ in range(layers)]
    lm_head = torch.randn(*SHAPES["llama lm_head"], device=device, dtype=dtype) * 0.02
    x = torch.randn(1, 4096, device=device, dtype=dtype) * 0.1
    mid = torch.randn(1, 14336, device=device, dtype=dtype) * 0.1

    def matmul(inp, w):
        if use_gemv:
            return gemv(inp, w, config=configs.get(tuple(w.shape)))
        return F.linear(inp, w)

    def step():
        for qkv, o, gate_up, down in weights:   # inputs of the right widths; the math is not the point
            matmul(x, qkv)
            matmul(x, o)
            matmul(x, gate_up)
            matmul(mid, down)
        matmul(x, lm_head)

    return time_ms(step, 1)


def measure_shape(n: int, k: int, device: str, dtype: torch.dtype, configs: list, default) -> dict:
    from cvllm_cuda.kernels.gemv import gemv

    w = shape_workload(n, k, device, dtype)
    x, weights = w["x"], w["weights"]
    base = time_ms(lambda: [F.linear(x, wt) for wt in weights], len(weights))
    timed = {}
    for config in configs:
        try:
            timed[config] = time_ms(lambda c=config: [gemv(x, wt, config=c) for wt in weights], len(weights))
        except Exception as e:   # a tile the compiler rejects (registers, shared memory): not a candidate
            print(f"  skip {astuple(config)}: {type(e).__name__}", file=sys.stderr)
    best = min(timed, key=timed.get)
    top = sorted(timed, key=timed.get)[:8]
    return {"out_features": n, "in_features": k, "weight_bytes": w["bytes"], "cublas_us": base * 1e3,
            "default_us": timed[default] * 1e3, "best": astuple(best), "best_us": timed[best] * 1e3,
            "top": [(astuple(c), timed[c] * 1e3) for c in top], "best_config": best, "all_us": timed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--write", type=Path, help="write tuned_gemv.py here with this GPU's entries merged in")
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: Triton's interpreter, two small shapes")
    args = ap.parse_args()
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
    from cvllm_cuda.kernels.gemv import DEFAULT_CONFIG

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    gpu = "cpu (interpreter)" if args.tiny else torch.cuda.get_device_name()
    shapes = TINY_SHAPES if args.tiny else SHAPES
    result = {"bench": "tune_gemv", "gpu": gpu, "commit": git_commit(), "date": datetime.date.today().isoformat(),
              "command": "python " + " ".join(sys.argv), "dtype": str(dtype).removeprefix("torch."), "shapes": {}}
    entries, best_configs, all_us = {}, {}, {}
    print(f"{'shape':20s} {'cuBLAS':>16s} {'default':>16s} {'best':>16s}  best tile (n, k, warps, stages)")
    for name, (n, k) in shapes.items():
        row = measure_shape(n, k, device, dtype, candidates(args.tiny) + [DEFAULT_CONFIG], DEFAULT_CONFIG)
        best = row.pop("best_config")
        all_us[name] = row.pop("all_us")
        print(f"{name:20s} " + " ".join(f"{row[key]:7.1f}us {row['weight_bytes'] / row[key] / 1e6:4.2f}TB/s"
                                        for key in ("cublas_us", "default_us", "best_us")) + f"  {row['best']}")
        result["shapes"][name] = row
        best_configs[(n, k)] = best
        if row["best_us"] < 0.98 * row["default_us"] and best != DEFAULT_CONFIG:
            entries[(n, k, result["dtype"])] = row["best"]
    # the one tile closest to each shape's best over all shapes: what gemv.DEFAULT_CONFIG should be
    common = set.intersection(*(set(t) for t in all_us.values()))
    overall = min(common, key=lambda c: statistics.geometric_mean([t[c] / min(t.values()) for t in all_us.values()]))
    result["best_overall"] = astuple(overall)
    result["best_overall_vs_best"] = statistics.geometric_mean([t[overall] / min(t.values()) for t in all_us.values()])
    print(f"one tile for all shapes: {astuple(overall)}, {result['best_overall_vs_best']:.3f}x each shape's best "
          f"(geometric mean)")
    if not args.tiny:
        layers = 32
        chain = {}
        from cvllm_cuda.kernels import pdl

        for key, use_gemv, use_pdl in [("cublas", False, True), ("gemv_tuned", True, True),
                                       ("gemv_tuned_no_pdl", True, False)]:
            os.environ["CVLLM_PDL"] = "1" if use_pdl else "0"
            pdl._enabled.cache_clear()
            chain[key] = chain_ms(layers, device, dtype, use_gemv, best_configs)
            torch.cuda.empty_cache()
        os.environ.pop("CVLLM_PDL")
        pdl._enabled.cache_clear()
        result["chain_ms_per_token"] = chain
        result["chain_tok_s"] = {key: 1e3 / ms for key, ms in chain.items()}
        print("\nmatmul chain of one Llama-3-8B token (32 layers + lm_head, 15 GB):")
        for key, ms in chain.items():
            print(f"  {key:14s} {ms:6.3f} ms  {1e3 / ms:6.1f} tok/s")
    print(f"\nTUNED_GEMV entry for {gpu!r} (commit {result['commit']}, {result['date']}):")
    print(f"    {gpu!r}: {{" + ", ".join(f"{k!r}: {v!r}" for k, v in entries.items()) + "},")
    result["entries"] = {repr(k): v for k, v in entries.items()}
    result["geomean_vs_cublas"] = statistics.geometric_mean(
        [s["best_us"] / s["cublas_us"] for s in result["shapes"].values()])
    if args.write and not args.tiny:
        provenance = (f"bench/tune_gemv.py at {result['commit']}, {result['date']} "
                      f"(bench/results/{result['date']}-h200-tune_gemv-{result['commit']}.json)")
        args.write.write_text(module_text(gpu, entries, provenance))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def module_text(gpu: str, entries: dict, provenance: str) -> str:
    """tuned_gemv.py with this GPU's entries merged into the committed table."""
    import cvllm_cuda.kernels.tuned_gemv as module

    tuned = {**module.TUNED_GEMV, gpu: {**module.TUNED_GEMV.get(gpu, {}), **entries}}
    lines = [f'"""{module.__doc__.strip()}"""', "",
             "TUNED_GEMV: dict[str, dict[tuple[int, int, str], tuple[int, int, int, int]]] = {"]
    for name, table in sorted(tuned.items()):
        lines += [f"    # {provenance}", f'    "{name}": {{']
        lines += [f'        ({n}, {k}, "{dtype}"): {value!r},' for (n, k, dtype), value in sorted(table.items())]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def astuple(config) -> tuple[int, int, int, int]:
    return (config.block_n, config.block_k, config.num_warps, config.num_stages)


if __name__ == "__main__":
    main()
