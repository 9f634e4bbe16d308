"""The low-bit GEMM of decode batches (cvllm_cuda/kernels/quant_matmul.py, 2 to GEMM_MAX_ROWS rows) on
Llama-3-8B's projection shapes, by rows of x: the unpacked kernel's tiles and the per-position kernel's default,
against bf16 cuBLAS and dequantize + cuBLAS, and the int8-activation GEMV of 1-8 rows that GGUF layouts without a
high plane take instead (quant_gemv_int8.MAX_ROWS), each timed as a layer's four products in one CUDA graph (two
layers' weights, so that they come from HBM; a launch's host cost is not counted, as in the decode graphs). The
kernels compile first in worker processes (Triton's disk cache), each tile checked against float32 on a smaller
weight; the main process then times them one at a time. ``--best-config FILE`` writes the fastest unpacked tile per
plane width at ``--pick-rows`` rows.

    python bench/quant_gemm_rows.py --json $OUT/quant_gemm_rows.json          # on the H200 (~3 min)
    TRITON_INTERPRET=1 python bench/quant_gemm_rows.py --smoke                # the code path, on a CPU
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))
from common import captured_us, command_line  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: Triton's interpreter (a smoke run: --smoke)
ROWS = (2, 4, 8, 16, 64, 128)
GEMV_ROWS = (1, 2, 4, 8)   # the int8-activation GEMV of GGUF layouts without a high plane (quant_gemv_int8.MAX_ROWS)
LAYERS = 2
# the unpacked kernel's (BLOCK_N, BLOCK_W at 4-bit, warps, stages): BLOCK_W scales with the plane width, so that a K
# step is BLOCK_W * 8 elements at every width. (On the H200 at 0396969: (64, 32, 4, 3) and (256, 16, 8, 3) ran out
# of shared memory for q4_k.)
UNPACKED = [(128, 8, 4, 4), (64, 16, 4, 4), (64, 16, 4, 3), (128, 16, 4, 3), (128, 8, 4, 3), (128, 8, 8, 4),
            (256, 8, 8, 3), (64, 8, 4, 4), (32, 16, 4, 3), (128, 4, 4, 4)]


def configs(low_bits: int):
    from cvllm_cuda.kernels.quant_matmul import PER_POSITION_CONFIGS
    yield "per-position", PER_POSITION_CONFIGS[low_bits]
    for bn, bw, warps, stages in UNPACKED:
        yield "unpacked", (bn, max(1, bw * low_bits // 4), warps, stages)


def planes_on_gpu(layout, n: int, k: int):
    """A weight of random words and factors drawn on the GPU (timing only: no value is checked)."""
    from cvllm_cuda.quant_planes import QuantWeight
    words = lambda bits: torch.randint(-2**31, 2**31 - 1, (k * bits // 32, n), dtype=torch.int32, device=DEV)  # noqa: E731
    half = lambda: (torch.rand(k // layout.super_group, n, device=DEV) * 1e-2).half()   # noqa: E731
    scales = k // layout.scale_group
    small = lambda dt: torch.randint(0, 64, (scales, n), device=DEV).to(dt)   # noqa: E731
    low = words(layout.low_bits)
    if layout.float8:
        low &= 0x3F3F3F3F
    return QuantWeight(layout, n, k, low=low, high=words(layout.high_bits) if layout.high_bits else None, d=half(),
                       m=half() if layout.has_m else None,
                       a=small(torch.int8 if layout.a_mode == 1 else torch.uint8) if layout.a_mode else None,
                       b=small(torch.uint8) if layout.b_mode == 2 else None)


def compile_and_check(job):
    """Worker: compile one (layout, kernel, tile) at every rows and shape; its max error against float32."""
    name, kernel, cfg, shapes = job
    from test_quant_matmul import LAYOUTS, random_weight

    from cvllm_cuda.kernels.quant_matmul import quant_gemm
    from cvllm_cuda.quant_planes import dequantize_planes
    layout = LAYOUTS[name]
    try:
        n0, k0 = (1024, 4096) if DEV == "cuda" else (64, 512)
        small = random_weight(layout, n0, k0, DEV, seed=1)
        ref_w = dequantize_planes(small).T
        err = 0.0
        for t in ROWS:
            x = torch.randn(t, k0, device=DEV, dtype=torch.bfloat16)
            out = torch.empty(t, n0, device=DEV, dtype=torch.bfloat16)
            quant_gemm(x, small, out, cfg, kernel=kernel)
            ref = x.float() @ ref_w
            err = max(err, ((out.float() - ref).abs().max() / ref.abs().max()).item())
        for n, k in shapes:
            weight = planes_on_gpu(layout, n, k)
            for t in ROWS:
                x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
                quant_gemm(x, weight, torch.empty(t, n, device=DEV, dtype=torch.bfloat16), cfg, kernel=kernel)
        return job[:3], err, None
    except Exception as exc:   # out of shared memory or registers, a compile error
        return job[:3], None, f"{type(exc).__name__}: {str(exc)[:200]}"


def layer_us(gemm) -> float:
    """``gemm(layer, shape)`` for every layer and shape, captured in one CUDA graph: microseconds a layer."""
    run = lambda: [gemm(layer, shape) for layer in range(LAYERS) for shape in SHAPES]   # noqa: E731
    if DEV == "cpu":   # the smoke run: the code path, not a time
        started = time.perf_counter()
        run()
        return (time.perf_counter() - started) * 1e6 / LAYERS
    return captured_us(run, per=LAYERS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="q4_k,q8_0,gptq4_g128,q6_k")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--pick-rows", type=int, default=64)
    ap.add_argument("--best-config", help="write {low_bits: [BLOCK_N, BLOCK_W, warps, stages]} here")
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, two layouts (TRITON_INTERPRET=1, no GPU)")
    args = ap.parse_args()
    if args.smoke:
        SHAPES.clear()
        SHAPES.update({"o": (64, 512), "down": (32, 1024)})
        args.layouts = "q4_k,q6_k"
    from test_quant_matmul import LAYOUTS

    from cvllm_cuda.kernels.quant_matmul import dequantize_weight, quant_gemm
    names = args.layouts.split(",")
    jobs = [(name, kernel, cfg, list(SHAPES.values()))
            for name in names for kernel, cfg in configs(LAYOUTS[name].low_bits)]
    started = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        checked = pool.map(compile_and_check, jobs, chunksize=1)
    print(f"compiled and checked {len(jobs)} kernels in {time.perf_counter() - started:.0f} s", flush=True)
    results = {"bf16": {}, "dequant+cublas": {}, "gemm": {}, "errors": {}}
    for (name, kernel, cfg), err, problem in checked:
        results["errors"][f"{name}/{kernel}/{cfg}"] = problem or err
        if problem:
            print(f"  {name} {kernel} {cfg}: {problem}", flush=True)
        elif err > 2e-2:
            print(f"  {name} {kernel} {cfg}: max error {err:.1e} of the largest output", flush=True)
    xs = {t: {s: torch.randn(t, k, device=DEV, dtype=torch.bfloat16) for s, (_, k) in SHAPES.items()} for t in ROWS}
    outs = {t: {s: torch.empty(t, n, device=DEV, dtype=torch.bfloat16) for s, (n, _) in SHAPES.items()} for t in ROWS}
    w16 = [{s: torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for s, (n, k) in SHAPES.items()}
           for _ in range(LAYERS)]
    for t in ROWS:
        results["bf16"][t] = layer_us(lambda i, s: torch.matmul(xs[t][s], w16[i][s].t(), out=outs[t][s]))  # noqa: B023
    w16.clear()
    for name in names:
        weights = [{s: planes_on_gpu(LAYOUTS[name], n, k) for s, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
        results["dequant+cublas"][f"{name}/64"] = layer_us(lambda i, s: torch.matmul(
            xs[64][s], dequantize_weight(weights[i][s], torch.bfloat16), out=outs[64][s]))  # noqa: B023
        for t in ROWS:
            for (jname, kernel, cfg), _, problem in checked:
                if jname == name and not problem:
                    results["gemm"][f"{name}/{kernel}/{cfg}/{t}"] = layer_us(
                        lambda i, s: quant_gemm(xs[t][s], weights[i][s], outs[t][s], cfg, kernel=kernel))  # noqa: B023
        weights.clear()   # (before the next layout's are drawn)
    # the int8 GEMV of the GGUF layouts that have it, by rows (what quant_matmul takes up to MAX_ROWS rows)
    import dataclasses

    from cvllm_cuda.kernels import quant_gemv_int8
    results["int8_gemv"] = {}
    for name in names:
        layout = dataclasses.replace(LAYOUTS[name], int8_activations=True)
        if not quant_gemv_int8.applies(layout, 4096):
            continue
        weights = [{s: planes_on_gpu(layout, n, k) for s, (n, k) in SHAPES.items()} for _ in range(LAYERS)]
        for t in GEMV_ROWS:
            gx = {s: torch.randn(t, k, device=DEV, dtype=torch.bfloat16) for s, (_, k) in SHAPES.items()}
            gout = {s: torch.empty(t, n, device=DEV, dtype=torch.bfloat16) for s, (n, _) in SHAPES.items()}
            us = layer_us(lambda i, s: quant_gemv_int8.quant_gemv_int8(gx[s], weights[i][s], gout[s]))  # noqa: B023
            results["int8_gemv"][f"{name}/{t}"] = us
            print(f"{name:11s} T={t:<4d} int8 GEMV {us:7.1f} us a layer", flush=True)
        weights.clear()
    # per layout and rows: bf16, the per-position kernel, the best unpacked tile
    best_cfg = {}
    table = {}
    for name in names:
        for t in ROWS:
            line = f"{name:11s} T={t:<4d} bf16 {results['bf16'][t]:7.1f} us a layer"
            for kernel in ("per-position", "unpacked"):
                timed = {cfg: results["gemm"][f"{name}/{kernel}/{cfg}/{t}"]
                         for (jname, k, cfg), _, problem in checked if jname == name and k == kernel and not problem}
                if timed:
                    cfg, us = min(timed.items(), key=lambda kv: kv[1])
                    table[f"{name}/{t}/{kernel}"] = [list(cfg), us]
                    line += f" | {kernel} {us:7.1f} {cfg}"
                    bits = LAYOUTS[name].low_bits
                    faster = bits not in best_cfg or us < best_cfg[bits][1]
                    if kernel == "unpacked" and t == args.pick_rows and faster:
                        best_cfg[bits] = (list(cfg), us)
            if t == 64:
                line += f" | dequantize + cuBLAS {results['dequant+cublas'][f'{name}/64']:7.1f}"
            print(line, flush=True)
    results["table"] = table
    if args.best_config:
        Path(args.best_config).write_text(json.dumps({b: c for b, (c, _) in best_cfg.items()}))
        print("best at", args.pick_rows, "rows:", {b: c for b, (c, _) in best_cfg.items()})
    if args.json:
        device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
        Path(args.json).write_text(json.dumps({"bench": "quant_gemm_rows", "command": command_line(),
                                               "device": device, **results}, indent=1))


if __name__ == "__main__":
    main()
