"""The batch-1 low-bit GEMV as a model runs it: a stack of Llama-3-8B layers' four projections (qkv, o, gate_up,
down), each layer its own weights (8 layers of Q4_K are ~1 GB: nothing stays in the 60 MB L2), captured in one CUDA
graph and replayed, for each tile config and K-split policy. Unlike ``quant_matmul_sweep.py`` (do_bench of one
launch, ~5 us of launch and ramp included) this counts what a decode step pays: the activation quantizer and
split-sum launches, PDL overlap, and back-to-back kernels.

    python bench/quant_gemv_stack.py --json $OUT/quant_gemv_stack.json          # on the H200 (~4 min)
    python bench/quant_gemv_stack.py --layouts q4_k --configs "32,32,4,1" --pps 4
    python bench/quant_gemv_stack.py --defaults --layouts q4_k,q8_0      # each layout's default tiles and split

Prints microseconds per layer (the four GEMVs), TB/s over the planes' and factors' bytes, and bf16 ``F.linear``
on the same stack.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
from common import captured_us

from cvllm_cuda.kernels import quant_gemv_int8, quant_tiles
from cvllm_cuda.kernels.gemv import gemv
from cvllm_cuda.kernels.quant_gemv import quant_gemv
from cvllm_cuda.kernels.sizes import cdiv
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYOUTS = {   # as the GGUF plugin and GPTQ repack them (int8 activations: GGUF's, llama.cpp's numerics)
    "q4_k": QuantLayout(4, 0, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True),
    "q8_0": QuantLayout(8, 0, 32, 32, b_const=-128, int8_activations=True),
    "q6_k": QuantLayout(4, 2, 16, 256, a_mode=1, b_mode=1, b_const=-32),   # the float GEMV
    # the int8 GEMV's high planes (CVLLM_QUANT_INT8_HIGH_PLANES=1; quant_gemv_int8 itself is timed here either way)
    "q6_k_int8": QuantLayout(4, 2, 16, 256, a_mode=1, b_mode=1, b_const=-32, int8_activations=True),
    "q5_k_int8": QuantLayout(4, 1, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True),
    "gptq4_g128": QuantLayout(4, 0, 128, 128, b_mode=2, b_const=-1),
    # GPTQ on int8 activations (CVLLM_GPTQ_INT8_ACTIVATIONS=1, cvllm_marlin/planes.py)
    "gptq4_g128_int8": QuantLayout(4, 0, 128, 128, b_mode=2, b_const=-1, int8_activations=True),
}


def random_planes(layout: QuantLayout, n: int, k: int, device: str = "cuda") -> QuantWeight:
    """Random words and small factors drawn on the GPU (the values do not matter for timing, only finite sums; on
    the "meta" device: their sizes only)."""
    def words(bits):
        return torch.randint(-(1 << 31), 1 << 31, (k * bits // 32, n), dtype=torch.int32, device=device)

    def half(rows):
        return (torch.rand(rows, n, device=device) * 1e-3).half()

    def byte(dtype):
        return torch.randint(0, 64, (k // layout.scale_group, n), device=device).to(dtype)

    return QuantWeight(layout, n, k, words(layout.low_bits), words(layout.high_bits) if layout.high_bits else None,
                       half(k // layout.super_group), half(k // layout.super_group) if layout.has_m else None,
                       byte(torch.int8 if layout.a_mode == 1 else torch.uint8) if layout.a_mode else None,
                       byte(torch.uint8) if layout.b_mode == 2 else None)


def splits_for(weight: QuantWeight, block_n: int, block_w: int, pps: int) -> int:
    programs = cdiv(weight.out_features, block_n)
    steps = cdiv(weight.in_features * weight.layout.low_bits // 32, block_w)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return max(1, min(cdiv(pps * sms, programs), steps // 4, 16))


def gemv_configs(spec: str | None):
    if spec:
        return [tuple(int(v) for v in c.split(",")) for c in spec.split(";")]
    return [c for c in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (1, 3))
            if 4 <= c[0] * c[1] / (c[2] * 32) <= 32]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="q4_k,q8_0,gptq4_g128")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", help='"BN,BW,WARPS,STAGES;..." (default: a grid)')
    ap.add_argument("--pps", default="4,8,16", help="programs per SM the K split aims at (0: K never split)")
    ap.add_argument("--budget-s", type=float, default=420)
    ap.add_argument("--defaults", action="store_true", help="each layout's default config and split only")
    ap.add_argument("--json")
    args = ap.parse_args()
    started = time.perf_counter()
    results: dict = {"bf16": {}, "planes": {}}
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in SHAPES.values()}}
    outs = {n: torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for n in {n for n, _ in SHAPES.values()}}
    dense = [{s: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for s, (n, k) in SHAPES.items()}
             for _ in range(args.layers)]

    def bf16_stack(dense=dense):
        for layer in dense:
            for s, (n, k) in SHAPES.items():
                torch.matmul(xs[k], layer[s].T, out=outs[n])

    def bf16_gemv_stack(dense=dense):   # the Triton GEMV the CUDA backend runs for one token (kernels/linear.py)
        for layer in dense:
            for s, (n, k) in SHAPES.items():
                outs[n] = gemv(xs[k], layer[s])

    bf16 = captured_us(bf16_stack, args.layers)
    bf16_gemv = captured_us(bf16_gemv_stack, args.layers)
    dense_bytes = sum(n * k * 2 for n, k in SHAPES.values())
    results["bf16"] = {"us_per_layer": bf16, "tb_s": dense_bytes / bf16 / 1e6, "gemv_us_per_layer": bf16_gemv}
    print(f"bf16 F.linear: {bf16:7.1f} us/layer {dense_bytes / bf16 / 1e6:5.2f} TB/s; Triton GEMV {bf16_gemv:7.1f} "
          f"us/layer {dense_bytes / bf16_gemv / 1e6:5.2f} TB/s", flush=True)
    del dense, bf16_stack, bf16_gemv_stack
    torch.cuda.empty_cache()
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        layers = [{s: random_planes(layout, n, k) for s, (n, k) in SHAPES.items()} for _ in range(args.layers)]
        nbytes = sum(w.nbytes() for w in layers[0].values())
        kernel = quant_gemv_int8.quant_gemv_int8 if layout.int8_activations else quant_gemv
        rows = {}
        if args.defaults:
            def stack(layers=layers, kernel=kernel):
                for layer in layers:
                    for s, (n, k) in SHAPES.items():
                        kernel(xs[k], layer[s], outs[n])

            rows["default"] = captured_us(stack, args.layers)
            if layout.int8_activations:   # what the quantizer's and the split sums' launches cost in the stack
                packed = {k: quant_gemv_int8.quantize_activations(x, layout.low_bits) for k, x in xs.items()}

                def gemv_only(layers=layers, packed=packed, splits=None):
                    for layer in layers:
                        for s, (n, k) in SHAPES.items():
                            quant_gemv_int8.quant_gemv_int8(xs[k], layer[s], outs[n], splits=splits,
                                                            activations=packed[k])

                rows["default, x quantized once"] = captured_us(gemv_only, args.layers)
                rows["default, x quantized once, K not split"] = captured_us(
                    lambda: gemv_only(splits=1), args.layers)
        for cfg in [] if args.defaults else gemv_configs(args.configs):
            for pps in (int(p) for p in args.pps.split(",")):
                if time.perf_counter() - started > args.budget_s:
                    break

                def stack(cfg=cfg, pps=pps, layers=layers, kernel=kernel):
                    for layer in layers:
                        for s, (n, k) in SHAPES.items():
                            w = layer[s]
                            kernel(xs[k], w, outs[n], cfg, splits_for(w, cfg[0], cfg[1], pps))
                try:
                    us = captured_us(stack, args.layers)
                except Exception as exc:   # out of registers or shared memory
                    print(f"  {name} {cfg} pps {pps}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
                    continue
                rows[f"{cfg} pps {pps}"] = us
        best = sorted(rows.items(), key=lambda kv: kv[1])
        results["planes"][name] = {"bytes_per_layer": nbytes, "us_per_layer": rows}
        int8 = layout.int8_activations
        default, pps = quant_gemv_int8.default_tiles(layout) if int8 else (None, quant_tiles.PROGRAMS_PER_SM)
        print(f"{name}: {nbytes / 1e6:.1f} MB/layer; default {default} pps {pps}", flush=True)
        for key, us in best[:8]:
            print(f"  {key:24s} {us:7.1f} us/layer {nbytes / us / 1e6:5.2f} TB/s  x{bf16 / us:4.2f} vs bf16",
                  flush=True)
        del layers
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
