"""The low-bit GEMM of decode batches (cvllm_cuda/kernels/quant_matmul.py, 2 to GEMM_MAX_ROWS rows) on
Llama-3-8B's projection shapes: each kernel variant ("per-position": a ``tl.dot`` per element position of the words;
"unpacked": one ``tl.dot`` a K step over the words unpacked by a reshape; "gather": the same with each word loaded
once per element) and tile config, against bf16 ``F.linear`` and dequantize + cuBLAS, by rows of x. The kernels
compile first in worker processes (Triton's disk cache), each config checked against float32 on a smaller weight;
then the main process times them one at a time. Prints, per layout and rows, a layer's four GEMMs summed for the
best config of each variant; ``--best-config FILE`` writes the fastest q4_k/q8_0 configs at ``--pick-rows`` rows.

    python bench/quant_gemm_rows.py --json $OUT/quant_gemm_rows.json          # on the H200 (~3 min)

Times are triton.testing.do_bench medians (the L2 flushed before each call), microseconds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # cpu: Triton's interpreter (a smoke run: --smoke)
ROWS = (4, 16, 64, 128)
# (BLOCK_N, BLOCK_W at 4-bit, warps, stages): BLOCK_W scales with the plane width so that a K step stays
# BLOCK_W * 32 / bits elements
UNPACKED = [(64, 16, 4, 3), (128, 16, 4, 3), (64, 32, 4, 3), (128, 8, 4, 4), (256, 16, 8, 3), (128, 16, 8, 3),
            (64, 16, 4, 4), (32, 16, 4, 3)]
GATHER = UNPACKED[:4]
PER_POSITION = [(32, 64, 4, 3)]   # the old default


def configs(low_bits: int):
    scale = lambda bw: max(1, bw * low_bits // 4)   # noqa: E731
    for variant, table in (("per-position", PER_POSITION), ("unpacked", UNPACKED), ("gather", GATHER)):
        for bn, bw, warps, stages in table:
            yield variant, (bn, bw if variant == "per-position" else scale(bw), warps, stages)


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
    """Worker: compile one (layout, variant, config) at every rows and shape; its max error against float32."""
    name, variant, cfg, shapes = job
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
            quant_gemm(x, small, out, (*cfg, 0, variant))
            ref = x.float() @ ref_w
            err = max(err, ((out.float() - ref).abs().max() / ref.abs().max()).item())
        for n, k in shapes:
            weight = planes_on_gpu(layout, n, k)
            for t in ROWS:
                x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
                quant_gemm(x, weight, torch.empty(t, n, device=DEV, dtype=torch.bfloat16), (*cfg, 0, variant))
        return job[:3], err, None
    except Exception as exc:   # out of shared memory or registers, a compile error
        return job[:3], None, f"{type(exc).__name__}: {str(exc)[:200]}"


def time_us(fn) -> float:
    if DEV == "cpu":   # the smoke run: the code path, not a time
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e6
    return triton.testing.do_bench(fn, warmup=5, rep=25) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="q4_k,q8_0,gptq4_g128,q6_k")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--pick-rows", type=int, default=64)
    ap.add_argument("--best-config", help="write {low_bits: [BN, BW, warps, stages, 0, variant]} here")
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
    jobs = [(name, variant, cfg, list(SHAPES.values()))
            for name in names for variant, cfg in configs(LAYOUTS[name].low_bits)]
    started = time.perf_counter()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        checked = pool.map(compile_and_check, jobs, chunksize=1)
    print(f"compiled and checked {len(jobs)} kernels in {time.perf_counter() - started:.0f} s", flush=True)
    results = {"bf16": {}, "dequant+cublas": {}, "gemm": {}, "errors": {}}
    for (name, variant, cfg), err, problem in checked:
        results["errors"][f"{name}/{variant}/{cfg}"] = problem or err
        if problem:
            print(f"  {name} {variant} {cfg}: {problem}", flush=True)
    for shape, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
        for t in ROWS:
            x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
            results["bf16"][f"{shape}/{t}"] = time_us(lambda: F.linear(x, w16))  # noqa: B023, F821  (called at once)
        del w16
    for name in names:
        layout = LAYOUTS[name]
        for shape, (n, k) in SHAPES.items():
            weight = planes_on_gpu(layout, n, k)
            x = torch.randn(64, k, device=DEV, dtype=torch.bfloat16)
            results["dequant+cublas"][f"{name}/{shape}/64"] = time_us(
                lambda: x @ dequantize_weight(weight, torch.bfloat16))  # noqa: B023, F821
            for t in ROWS:
                x = torch.randn(t, k, device=DEV, dtype=torch.bfloat16)
                out = torch.empty(t, n, device=DEV, dtype=torch.bfloat16)
                for (jname, variant, cfg), _, problem in checked:
                    if jname != name or problem:
                        continue
                    results["gemm"][f"{name}/{variant}/{cfg}/{shape}/{t}"] = time_us(
                        lambda: quant_gemm(x, weight, out, (*cfg, 0, variant)))  # noqa: B023, F821
            del weight
    # a layer's four GEMMs summed, per layout, rows and variant: the best config of each
    best_cfg = {}
    table = {}
    for name in names:
        for t in ROWS:
            bf16 = sum(results["bf16"][f"{s}/{t}"] for s in SHAPES)
            line = f"{name:11s} T={t:<4d} bf16 {bf16:7.1f} us"
            for variant in ("per-position", "unpacked", "gather"):
                sums = {}
                for (jname, v, cfg), _, problem in checked:
                    if jname == name and v == variant and not problem:
                        sums[cfg] = sum(results["gemm"][f"{name}/{v}/{cfg}/{s}/{t}"] for s in SHAPES)
                if sums:
                    cfg, us = min(sums.items(), key=lambda kv: kv[1])
                    table[f"{name}/{t}/{variant}"] = [list(cfg), us]
                    line += f" | {variant} {us:7.1f} {cfg}"
                    if t == args.pick_rows and name in ("q4_k", "q8_0", "gptq4_g128"):
                        bits = LAYOUTS[name].low_bits
                        if bits not in best_cfg or us < best_cfg[bits][1]:
                            best_cfg[bits] = ([*cfg, 0, variant], us)
            print(line, flush=True)
    results["table"] = table
    if args.best_config:
        Path(args.best_config).write_text(json.dumps({b: c for b, (c, _) in best_cfg.items()}))
        print("best at", args.pick_rows, "rows:", {b: c for b, (c, _) in best_cfg.items()})
    if args.json:
        device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu"
        Path(args.json).write_text(json.dumps({"bench": "quant_gemm_rows", "command": " ".join(sys.argv),
                                               "device": device, **results}, indent=1))


if __name__ == "__main__":
    main()
