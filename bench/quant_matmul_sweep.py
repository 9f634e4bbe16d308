"""Tile sweep of the low-bit plane matmul (cvllm_cuda/kernels/quant_matmul.py) on Llama-3-8B's projection shapes:
for each layout, every GEMV config at T=1 and a few GEMM configs at T=8 and T=256, against bf16 ``F.linear`` on the
same shape. Prints the best configs; the chosen ones go into GEMV_CONFIGS / GEMM_CONFIGS.

    python bench/quant_matmul_sweep.py --json $OUT/quant_matmul_sweep.json          # on the H200
    python bench/quant_matmul_sweep.py --layouts q4_k --shapes o --budget-s 60

Times are triton.testing.do_bench medians (the L2 is flushed before each call: weights come from HBM), in
microseconds; GB/s counts the planes' bytes once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))
from test_quant_matmul import LAYOUTS, random_weight  # noqa: E402

from cvllm_cuda.kernels.quant_matmul import dequantize_weight, quant_gemm, quant_gemv  # noqa: E402
from cvllm_cuda.quant_planes import dequantize_planes  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def gemv_configs():
    for bn, bw, warps, stages in itertools.product((32, 64, 128), (8, 16, 32), (2, 4, 8), (1, 3)):
        per_thread = bn * bw / (warps * 32)
        if 2 <= per_thread <= 32:
            yield (bn, bw, warps, stages)


def gemm_configs():
    return [(bn, bw, 4, st) for bn in (32, 64, 128) for bw in (16, 32, 64) for st in (2, 3)]


DEQUANT = [(bn, bw, w) for bn in (64, 128, 256) for bw in (4, 8, 16) for w in (4,)]


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="q4_k,q8_0,q6_k,gptq4_g128")
    ap.add_argument("--shapes", default="o,gate_up,down,qkv")
    ap.add_argument("--gemm-layouts", default="q4_k,q8_0")
    ap.add_argument("--gemv-shapes", default="o,gate_up", help="shapes every GEMV config is timed on; the rest "
                    "take the three best")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--json")
    args = ap.parse_args()
    started = time.perf_counter()
    results: dict = {"gemv": {}, "gemm": {}, "bf16": {}, "dequant": {}}
    shapes = args.shapes.split(",")
    for shape in shapes:
        n, k = SHAPES[shape]
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for t in (1, 8, 256):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            results["bf16"][f"{shape}/{t}"] = time_us(lambda: F.linear(x, w16))  # noqa: B023, F821  (called at once)
        del w16
    for name in args.layouts.split(","):
        for shape in shapes:
            if time.perf_counter() - started > args.budget_s:
                break
            n, k = SHAPES[shape]
            weight = random_weight(LAYOUTS[name], n, k, "cuda")
            mb = weight.nbytes() / 1e6
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            ref = (x.float() @ dequantize_planes(weight).T)
            rows = {}
            # a layout with the low-plane width of one swept before takes that one's three best per shape
            sibling = next((other for other in args.layouts.split(",")
                            if LAYOUTS[other].low_bits == LAYOUTS[name].low_bits), name)
            swept = [results["gemv"][f"{sibling}/{sh}"] for sh in args.gemv_shapes.split(",")
                     if f"{sibling}/{sh}" in results["gemv"]]
            full = shape in args.gemv_shapes.split(",") and sibling == name
            configs = list(gemv_configs()) if full or not swept else list(
                {eval(c) for r in swept for c, _ in sorted(r.items(), key=lambda kv: kv[1][0])[:3]})
            for cfg in configs:
                if time.perf_counter() - started > args.budget_s:
                    break
                try:
                    quant_gemv(x, weight, out, cfg)
                    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    rows[cfg] = (time_us(lambda: quant_gemv(x, weight, out, cfg)), err)  # noqa: B023, F821  (called at once)
                except Exception as exc:   # e.g. out of shared memory or registers
                    print(f"  {name} {shape} gemv {cfg}: {type(exc).__name__}", flush=True)
            best = sorted(rows.items(), key=lambda kv: kv[1][0])[:5]
            results["gemv"][f"{name}/{shape}"] = {str(c): v for c, v in rows.items()}
            bf16 = results["bf16"][f"{shape}/1"]
            for cfg, (us, err) in best:
                print(f"gemv {name:5s} {shape:8s} {str(cfg):14s} {us:8.1f} us {mb / us:6.2f} TB/s "
                      f"x{bf16 / us:4.2f} vs bf16 err {err:.1e}", flush=True)
            if name not in args.gemm_layouts.split(","):
                continue
            for t in (8, 2, 16):
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
                ref = (x.float() @ dequantize_planes(weight).T)
                rows = {}
                # every config at T=8; the three best of those at T=2 and 16
                configs = gemm_configs() if t == 8 else [eval(c) for c, _ in sorted(
                    results["gemm"][f"{name}/{shape}/8"].items(), key=lambda kv: kv[1][0])[:3]]
                for cfg in configs:
                    if time.perf_counter() - started > args.budget_s:
                        break
                    try:
                        quant_gemm(x, weight, out, cfg)
                        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                        rows[cfg] = (time_us(lambda: quant_gemm(x, weight, out, cfg)), err)  # noqa: B023, F821  (called at once)
                    except Exception as exc:
                        print(f"  {name} {shape} gemm {cfg}: {type(exc).__name__}", flush=True)
                results["gemm"][f"{name}/{shape}/{t}"] = {str(c): v for c, v in rows.items()}
                bf16 = results["bf16"][f"{shape}/8"]
                for cfg, (us, err) in sorted(rows.items(), key=lambda kv: kv[1][0])[:3]:
                    print(f"gemm {name:5s} {shape:8s} T={t:<4d} {str(cfg):14s} {us:8.1f} us x{bf16 / us:4.2f} vs "
                          f"bf16 err {err:.1e}", flush=True)
            # decode batches of 64 and 256 rows: the dequantize-in-tile GEMM against dequantize + cuBLAS (which writes
            # and reads a bf16 copy of the weight every step): where GEMM_MAX_ROWS should be
            for t in (64, 256):
                x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
                rows = {}
                for cfg in [(bn, bw, w, 3, bm) for bn in (64, 128) for bw in (16, 32) for w in (4, 8)
                            for bm in (64, 128) if bm <= t]:
                    if time.perf_counter() - started > args.budget_s:
                        break
                    try:
                        rows[cfg] = time_us(lambda: quant_gemm(x, weight, out, cfg))  # noqa: B023, F821  (called at once)
                    except Exception as exc:
                        print(f"  {name} {shape} gemm {cfg}: {type(exc).__name__}", flush=True)
                both = time_us(lambda: x @ dequantize_weight(weight, torch.bfloat16))  # noqa: B023, F821
                timed = {str(c): v for c, v in rows.items()}
                results["gemm"][f"{name}/{shape}/{t}"] = {**timed, "dequant+cublas": both}
                if rows:
                    cfg, us = min(rows.items(), key=lambda kv: kv[1])
                    print(f"gemm {name:5s} {shape:8s} T={t:<4d} {str(cfg):20s} {us:8.1f} us; dequantize + cuBLAS "
                          f"{both:8.1f} us; bf16 {results['bf16'][f'{shape}/256']:.1f} us (T=256)", flush=True)
            # many rows: dequantize once (timed alone), then cuBLAS on the bf16 weight (what bf16 costs)
            rows = {}
            for cfg in DEQUANT:
                try:
                    rows[cfg] = time_us(lambda: dequantize_weight(weight, torch.bfloat16, cfg))  # noqa: B023, F821  (called at once)
                except Exception as exc:
                    print(f"  {name} {shape} dequant {cfg}: {type(exc).__name__}", flush=True)
            best = min(rows.items(), key=lambda kv: kv[1])
            exact = torch.equal(dequantize_weight(weight, torch.float32, best[0]), dequantize_planes(weight).T)
            results["dequant"][f"{name}/{shape}"] = {str(c): v for c, v in rows.items()}
            print(f"dequant {name:5s} {shape:8s} {str(best[0]):14s} {best[1]:8.1f} us ({n * k * 2 / best[1] / 1e6:.2f} "
                  f"TB/s written) exact={exact}; + bf16 F.linear T=256 {results['bf16'][f'{shape}/256']:.1f} us",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    for key, us in results["bf16"].items():
        print(f"bf16 {key:14s} {us:8.1f} us")


if __name__ == "__main__":
    main()
