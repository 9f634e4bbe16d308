"""Per-shape tiles for the batch-1 low-bit GEMVs (kernels/quant_gemv.py, quant_gemv_int8.py), timed as a model runs
them: each weight shape alone, a stack of ``--layers`` copies (each its own weights, more than the L2 holds) in one
CUDA graph, for every tile config and K split of ``quant_gemv_stack.py``'s grid. Prints, per layout and shape, the
default's time, the best and the entry for ``tuned_matmul.TUNED_QUANT_GEMV``.

    python bench/tune_quant_gemv.py --json $OUT/tune_quant_gemv.json            # on the H200 (~3 min a layout)
    python bench/tune_quant_gemv.py --layouts q4_k --shapes o,down --pps 1,2,4
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import captured_us
from quant_gemv_stack import LAYOUTS, SHAPES, gemv_configs, random_planes, splits_for

from cvllm_cuda.kernels.quant_gemv import quant_gemv
from cvllm_cuda.kernels.quant_gemv_int8 import quant_gemv_int8
from cvllm_cuda.kernels.tuned_matmul import quant_gemv_key


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="q4_k,q8_0,gptq4_g128,q6_k")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", help='"BN,BW,WARPS,STAGES;..." (default: quant_gemv_stack.py\'s grid)')
    ap.add_argument("--pps", default="1,2,4,8", help="programs per SM the K split aims at")
    ap.add_argument("--budget-s", type=float, default=500, help="per layout, shared out among its shapes")
    ap.add_argument("--json")
    args = ap.parse_args()
    results: dict = {}
    table: dict = {}
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        kernel = quant_gemv_int8 if layout.int8_activations else quant_gemv
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            weights = [random_planes(layout, n, k) for _ in range(args.layers)]

            def stack(cfg=None, splits=None, weights=weights, x=x, out=out, kernel=kernel):
                for w in weights:
                    kernel(x, w, out, cfg, splits)

            rows = {"default": captured_us(stack, args.layers)}
            tiles = {}   # row key -> (config, programs per SM)
            started = time.perf_counter()   # the budget is per shape: each gets its share of the grid
            for cfg in gemv_configs(args.configs):
                for pps in (int(p) for p in args.pps.split(",")):
                    if time.perf_counter() - started > args.budget_s / len(args.shapes.split(",")):
                        break
                    splits = splits_for(weights[0], cfg[0], cfg[1], pps)
                    key = f"{','.join(map(str, cfg))} pps {pps}"
                    try:
                        rows[key] = captured_us(lambda cfg=cfg, splits=splits: stack(cfg, splits), args.layers)
                        tiles[key] = (cfg, pps)
                    except Exception as exc:   # out of registers or shared memory
                        print(f"  {name} {shape} {cfg} pps {pps}: {type(exc).__name__}: {str(exc)[:60]}", flush=True)
            best_key, best = min(((key, us) for key, us in rows.items() if key != "default"),
                                 key=lambda kv: kv[1], default=("default", rows["default"]))
            if best_key != "default":   # the winner's output against the default tiles' (same rounding of x)
                cfg, pps = tiles[best_key]
                ref, got = torch.empty_like(out), torch.empty_like(out)
                kernel(x, weights[0], ref)
                kernel(x, weights[0], got, cfg, splits_for(weights[0], cfg[0], cfg[1], pps))
                error = ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
                if not error < 1e-2:
                    print(f"  {name} {shape} {best_key}: output differs from the default's ({error:.2e}): dropped")
                    best_key, best = "default", rows["default"]
            nbytes = weights[0].nbytes()
            print(f"{name:10s} {shape:8s} default {rows['default']:6.1f} us, best {best:6.1f} us ({best_key}) "
                  f"{nbytes / best / 1e6:4.2f} TB/s", flush=True)
            results.setdefault(name, {})[shape] = {"bytes": nbytes, "us": rows}
            if best_key != "default" and best < 0.97 * rows["default"]:
                cfg, pps = tiles[best_key]
                table[str(quant_gemv_key(n, k, layout, kernel is quant_gemv_int8))] = (*cfg, pps)
            del weights
            torch.cuda.empty_cache()
            if args.json:
                Path(args.json).write_text(json.dumps({"results": results, "table": table}, indent=1))
    print("TUNED_QUANT_GEMV entries (key: (block_n, block_w, warps, stages, programs per SM)):")
    for key, value in table.items():
        print(f"        {key}: {value},")


if __name__ == "__main__":
    main()
