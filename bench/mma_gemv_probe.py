"""Probe (issue 18): the tensor-core W4A16 GEMV (cvllm_cuda/kernels/quant_gemv_mma.py) against what quant_matmul
runs without it (GPTQ/AWQ: the float GEMV at 1 row, the swapped GEMM at 2-16; Q4_K: the int8 GEMV up to 5 rows, then
the swapped GEMM), on Llama-3-8B's projection shapes. The MMA GEMV's output is checked against float32 first; then a
stack of layers' four products is captured in one CUDA graph per kernel and timed (us a layer; the weights come from
HBM).

    python bench/mma_gemv_probe.py --json $OUT/mma_gemv_probe.json        # on the H200 (~1 min)
    python bench/mma_gemv_probe.py --rows 1,8 --configs "4,32;1,16,3;2,8,3"   # other tiles beside the defaults
    python bench/mma_gemv_probe.py --rows 1 --configs "4,32,1,64;4,24"        # ... a thread's registers capped at 64
    python bench/mma_gemv_probe.py --rows 1 --configs "4,16,1,0,1"            # ... the next K step loaded ahead
    python bench/mma_gemv_probe.py --rows 1 --configs "4,16,1,0,0,1"          # ... K splits added in the launch
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))
from common import captured_us  # noqa: E402
from quant_gemm_rows import SHAPES, planes_on_gpu  # noqa: E402

from cvllm_cuda.kernels.quant_gemv_mma import group_units, quant_gemv_mma, split_count  # noqa: E402
from cvllm_cuda.kernels.quant_gemv_mma import tile as quant_gemv_mma_tile  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_matmul  # noqa: E402
from cvllm_cuda.quant_planes import QuantLayout, dequantize_planes  # noqa: E402

LAYOUTS = {"gptq4_g128": QuantLayout(4, 0, 128, 128, b_mode=2, b_const=-1),   # (Q4_K as GGUF files and --isq have it)
           "q4_k": QuantLayout(4, 0, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True)}


def stack_us(layers: list, xs: dict, outs: dict, gemv, **kwargs) -> float:
    """us a layer of ``gemv(x, weight, out, **kwargs)`` over every layer's four shapes, in one CUDA graph."""
    def run():
        for layer in layers:
            for s in SHAPES:
                gemv(xs[s], layer[s], outs[s], **kwargs)
    return round(captured_us(run, len(layers)), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="gptq4_g128")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", default="", help='also "WARPS,WARPS_PER_SM[,STAGES[,REGISTERS[,PREFETCH[,FUSED]]]]'
                    ';..." of the MMA GEMV beside its defaults (quant_gemv_mma.TILES; one stage; registers: a cap on a '
                    "thread's, 0 none; PREFETCH 1: the kernel's PREFETCH; FUSED 1: K splits added in the launch)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import cvllm_cuda.kernels.quant_gemv_mma as mma
    mma.ENABLED = False   # the baseline is quant_matmul's kernel without it, whatever the environment says
    results = []
    for name in args.layouts.split(","):
        layout = LAYOUTS[name]
        layers = [{s: planes_on_gpu(layout, n, k) for s, (n, k) in SHAPES.items()} for _ in range(args.layers)]
        for t in (int(r) for r in args.rows.split(",")):
            xs = {s: torch.randn(t, k, device="cuda").to(torch.bfloat16) for s, (_, k) in SHAPES.items()}
            outs = {s: torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for s, (n, _) in SHAPES.items()}
            for s in SHAPES:   # correctness on the first layer's shapes against float32
                ref = xs[s].float() @ dequantize_planes(layers[0][s]).T
                quant_gemv_mma(xs[s], layers[0][s], outs[s])
                err = ((outs[s].float() - ref).abs().max() / ref.abs().max()).item()
                print(f"{name} rows {t} {s}: relative error {err:.2e}" + ("" if err < 1e-2 else "  WRONG"), flush=True)
            row = {"layout": name, "rows": t, "baseline": "quant_matmul's kernel (CVLLM_GEMV_MMA off)",
                   "baseline_us": stack_us(layers, xs, outs, quant_matmul),
                   "mma_us": stack_us(layers, xs, outs, quant_gemv_mma)}
            for spec in (c for c in args.configs.split(";") if c):
                warps, per_sm, stages, registers, prefetch, fused = (*(int(v) for v in spec.split(",")), 1, 0, 0, 0)[:6]

                def gemv(x, weight, out, warps=warps, per_sm=per_sm, stages=stages, registers=registers,
                         prefetch=bool(prefetch), fused=bool(fused)):
                    features = 8 * quant_gemv_mma_tile(x.shape[0])[0] * warps
                    splits = split_count(weight.out_features, weight.in_features, group_units(weight.layout),
                                         features, warps, per_sm, x.device)
                    quant_gemv_mma(x, weight, out, warps=warps, splits=splits, stages=stages, registers=registers,
                                   prefetch=prefetch, fused_sums=fused)
                name = (f"mma {warps} warps, {per_sm} warps/SM, {stages} stages{', prefetch' if prefetch else ''}"
                        f"{', fused sums' if fused else ''}")
                row[f"{name}, {registers or 'any'} registers"] = stack_us(layers, xs, outs, gemv)
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
