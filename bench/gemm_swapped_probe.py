"""Probe (issue 18): the swapped low-bit GEMM (cvllm_cuda/kernels/quant_gemm_swapped.py: the weight as the MMA's
first operand, unpacked into registers; 4-bit words two weights a lane in bf16) against today's unpacked GEMM, on
Llama-3-8B's projection shapes at decode-batch rows. Each kernel's output is checked against float32 first; then a
layer's four products (two layers' weights, so that they come from HBM) are captured in one CUDA graph per kernel and
tile, and timed. Compiled for sm_90 on a CPU (2026-12-04, q4_k, 64 rows): ~5.5 loop instructions a weight element in
lanes against ~9.9 for today's kernel; what a GPU makes of it is what this measures.

    python bench/gemm_swapped_probe.py --json $OUT/gemm_swapped_probe.json      # on the H200 (~2 min)
    python bench/gemm_swapped_probe.py --layouts q4_k,q8_0 --rows 1,2,3,4,5,8 --configs 64,8,4,4   # + int8 GEMV
    python bench/gemm_swapped_probe.py --rows 16,32,64 --configs 64,8,4,4 --splits auto,1,2,4    # K splits
    TRITON_INTERPRET=1 python bench/gemm_swapped_probe.py --check-only            # the numbers, on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))
from quant_gemm_rows import SHAPES, planes_on_gpu  # noqa: E402

from cvllm_cuda.kernels import quant_gemv_int8  # noqa: E402
from cvllm_cuda.kernels.quant_matmul import quant_gemm  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the swapped kernel's (BLOCK_N, BLOCK_W at 4-bit, warps, stages); BLOCK_M follows the rows (16, 32, 64, 128)
CONFIGS = [(128, 16, 4, 4), (128, 32, 4, 3), (64, 32, 4, 3), (128, 16, 8, 3), (64, 16, 4, 4)]
GEMV_MAX_ROWS = 8   # rows up to which the int8 GEMV is timed too (a program a row, and the rows together)


def scaled(config: tuple, low_bits: int) -> tuple:
    """A 4-bit config for ``low_bits``-bit planes: the same K step in elements."""
    block_n, block_w, warps, stages = config
    if low_bits == 4:   # lane order (bf16 x): a K step of 16 elements is enough
        return config
    return block_n, max(16, block_w * low_bits // 4), warps, stages   # a position's dot needs a K of 16 words


def check(names: list[str]) -> dict:
    """Each layout's relative max error against float32 on a small weight, at a few row counts."""
    from test_quant_matmul import LAYOUTS, random_weight

    from cvllm_cuda.quant_planes import dequantize_planes
    errors = {}
    n0, k0 = (1024, 4096) if DEV == "cuda" else (128, 512)
    for name in names:
        weight = random_weight(LAYOUTS[name], n0, k0, DEV, seed=1)
        ref_w = dequantize_planes(weight).T.float()
        for kernel in ("unpacked", "swapped"):
            worst = 0.0
            for t in (2, 16, 40) if DEV == "cpu" else (2, 16, 64, 128):
                x = torch.randn(t, k0, device=DEV, dtype=torch.bfloat16)
                out = torch.empty(t, n0, device=DEV, dtype=torch.bfloat16)
                config = None if DEV == "cuda" else (64, 16, 4, 1)
                quant_gemm(x, weight, out, config, kernel=kernel)
                ref = x.float() @ ref_w
                worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
            errors[f"{name} {kernel}"] = worst
            print(f"{name:11s} {kernel:9s} max error {worst:.2e} of the largest output", flush=True)
            assert worst < 2e-2, (name, kernel, worst)
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="q4_k,gptq4_g128", help="(q8_0, q6_k: position by position)")
    ap.add_argument("--rows", default="2,16,64,128")
    ap.add_argument("--configs", help="swapped tiles to time, 'BLOCK_N,BLOCK_W,warps,stages ...' (4-bit BLOCK_W)")
    ap.add_argument("--splits", default="auto",
                    help="K splits to time each swapped tile at, 'auto,1,2,4' (auto: quant_tiles.k_splits' choice)")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.layouts.split(",")
    from common import captured_us, command_line, git_commit

    result = {"bench": "gemm_swapped_probe", "command": command_line(), "errors": check(names)}
    if args.check_only:
        return
    from test_quant_matmul import LAYOUTS
    result.update(commit=git_commit(), gpu=torch.cuda.get_device_name(), us_per_layer={})
    configs = [tuple(map(int, c.split(","))) for c in args.configs.split()] if args.configs else CONFIGS
    for name in names:
        layout = LAYOUTS[name]
        layers = [{s: planes_on_gpu(layout, n, k) for s, (n, k) in SHAPES.items()} for _ in range(2)]
        # GGUF's layouts without a high plane also have the int8-activation GEMV (quant_matmul takes it up to
        # quant_gemv_int8.MAX_ROWS rows): the same weights with int8 activations on
        gemv_layout = dataclasses.replace(layout, int8_activations=True)
        gemv_layers = [{s: dataclasses.replace(w, layout=gemv_layout) for s, w in layer.items()} for layer in layers] \
            if quant_gemv_int8.applies(gemv_layout, 4096) else None
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k, device=DEV, dtype=torch.bfloat16) for _, k in SHAPES.values()}
            outs = {n: torch.empty(rows, n, device=DEV, dtype=torch.bfloat16) for n, _ in SHAPES.values()}

            def stack(kernel, config=None, splits=None, xs=xs, outs=outs, layers=layers):
                return lambda: [quant_gemm(xs[k], layer[s], outs[n], config, splits=splits, kernel=kernel)
                                for layer in layers for s, (n, k) in SHAPES.items()]

            row = {"unpacked (today)": captured_us(stack("unpacked"), per=2)}
            if gemv_layers and rows <= GEMV_MAX_ROWS:
                for label, per_program in (("int8 GEMV, a program a row", 1), ("int8 GEMV, rows together", rows)):
                    row[label] = captured_us(lambda per_program=per_program, xs=xs, outs=outs, ls=gemv_layers: [
                        quant_gemv_int8.quant_gemv_int8(xs[k], layer[s], outs[n], rows_per_program=per_program)
                        for layer in ls for s, (n, k) in SHAPES.items()], per=2)
            for config in configs:
                for splits in args.splits.split(","):
                    label = f"swapped {config}" + ("" if splits == "auto" else f" splits {splits}")
                    try:
                        row[label] = captured_us(stack("swapped", scaled(config, layout.low_bits),
                                                       None if splits == "auto" else int(splits)), per=2)
                    except Exception as exc:   # out of shared memory or registers
                        print(f"  {name} {rows} rows {label}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            result["us_per_layer"][f"{name} x {rows}"] = row
            best_us, best = min((us, key) for key, us in row.items() if key.startswith("swapped"))
            gemv = "".join(f", {key} {us:7.1f}" for key, us in row.items() if key.startswith("int8"))
            print(f"{name:11s} {rows:4d} rows: unpacked {row['unpacked (today)']:7.1f} us a layer, swapped best "
                  f"{best_us:7.1f} ({best}){gemv}", flush=True)
        del layers
        torch.cuda.empty_cache()
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
