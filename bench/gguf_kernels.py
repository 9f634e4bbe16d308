"""Time the GGUF in-place kernels (issue 18: cvllm_gguf.kernels.gguf_matmul) on Llama-3-8B's projection shapes
against bf16 ``F.linear`` on the same shape, every GGML type with a kernel, at T = 1, 4, 8 rows of x (the GEMV
path, T <= GEMV_MAX_ROWS) and 64, 256 (the dequantize-in-tile GEMM).

    python bench/gguf_kernels.py --json $OUT/gguf_kernels.json       # on the H200 (~3-4 min, compiles included)
    python bench/gguf_kernels.py --tiny                               # CPU rehearsal in Triton's interpreter
    python bench/gguf_kernels.py --types Q4_K,Q8_0 --shapes o,down --tokens 1,64

Weights are random valid blocks drawn on the GPU: random quant bytes, the f16 scale fields (d, dmin) overwritten
with finite halves of a checkpoint's size (1e-4..2e-3), as plugins/quant-gguf/tests/conftest.py builds them.
x is bf16 (randn), the output bf16 (gguf_matmul allocates it, as F.linear does).

Each time is triton.testing.do_bench's median (default 25 ms warm-up, 100 ms of repetitions) in microseconds; do_bench
zeroes a 256 MB buffer before every call, so the weights come from HBM, not the 50 MB L2 (no CUDA graphs: the cache
clear in front of each call keeps the GPU busy while the host launches). Effective weight GB/s = bytes of the
blocks (or of the bf16 weight) / time, the bytes counted once even where the GEMM reads them again per row tile;
TFLOP/s = 2 T N K / time; speed-up = bf16 F.linear time / gguf time (> 1: the blocks win).

Before timing a (type, shape), the kernel's output on the first 256 rows of the weight is compared with x @
dequantize(blocks).T at the smallest and largest T (max |diff| / max |ref|; > 2e-2 is flagged FAIL).

--tiny runs tiny shapes on the CPU through Triton's interpreter (TRITON_INTERPRET=1, set before the kernels are
imported), one call per time measured with a host timer: it checks the script, its times mean nothing.
--json is rewritten after every (shape, type), so a run stopped by a timeout leaves what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import GpuSampler, git_commit  # noqa: E402

TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
SHAPES = {  # Llama-3-8B, name: (out_features N, in_features K)
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
TOKENS = (1, 4, 8, 64, 256)
# K a multiple of 256 (the K-quants' super-blocks); N not a multiple of the GEMM's 64-row tiles (masking)
TINY_SHAPES = {"tiny_a": (48, 512), "tiny_b": (72, 256)}
TINY_TOKENS = (1, 4, 8, 16, 64)
CHECK_ROWS = 256      # rows of the weight the correctness check multiplies
CHECK_TOLERANCE = 2e-2

# byte offsets of the f16 scale fields in each block type (plugins/quant-gguf/tests/conftest.py's F16_FIELDS)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(qtype, n: int, k: int, device: str, gen):
    """uint8 [n, row_bytes]: random quant bytes, finite f16 scales of a real checkpoint's size."""
    import torch

    from cvllm_gguf.quant_types import FORMATS

    fmt = FORMATS[qtype]
    count = n * k // fmt.block_size
    blocks = torch.randint(0, 256, (count, fmt.type_size), dtype=torch.uint8, device=device, generator=gen)
    for offset in F16_FIELDS[qtype.name]:
        scales = torch.empty(count, dtype=torch.float16, device=device).uniform_(1e-4, 2e-3, generator=gen)
        blocks[:, offset:offset + 2] = scales.view(torch.uint8).view(count, 2)
    return blocks.view(n, count // n * fmt.type_size)


def check(qtype, qweight, k: int, tokens: list[int], device: str, gen) -> dict[int, float]:
    """max |gguf_matmul - x @ dequantize(W).T| / max |ref| on the first CHECK_ROWS rows, per T."""
    import torch

    from cvllm_gguf.dequant import dequantize
    from cvllm_gguf.kernels import gguf_matmul

    rows = qweight[:CHECK_ROWS].contiguous()
    w = dequantize(rows, qtype, (rows.shape[0], k))
    errors = {}
    for t in sorted({min(tokens), max(tokens)}):
        x = torch.randn(t, k, device=device, dtype=torch.bfloat16, generator=gen)
        ref = x.float() @ w.T
        out = gguf_matmul(x, rows, qtype, rows.shape[0], k).float()
        errors[t] = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return errors


def timer(tiny: bool, warmup: int, rep: int):
    """fn -> microseconds: do_bench's median on the GPU; one call on a host clock under --tiny."""
    if tiny:
        def host_us(fn) -> float:
            started = time.perf_counter()
            fn()
            return (time.perf_counter() - started) * 1e6
        return host_us

    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e3


def tile_defaults() -> dict:
    """The kernels' tile settings this run used (untuned defaults at issue 18 part 1)."""
    from cvllm_gguf.kernels import GEMV_MAX_ROWS, k_blocks, simple_blocks

    return {"gemv_max_rows": GEMV_MAX_ROWS,
            "simple": {name: getattr(simple_blocks, name) for name in (
                "GEMV_BLOCK_N", "GEMV_BLOCKS_K", "GEMV_WARPS", "GEMM_BLOCK_N", "GEMM_BLOCKS_K", "GEMM_WARPS",
                "GEMM_STAGES")},
            "k": {"GEMV_BLOCK_N": k_blocks.GEMV_BLOCK_N, "GEMV_WARPS": k_blocks.GEMV_WARPS,
                  "gemm_tile_64": list(k_blocks.gemm_tile(64)), "gemm_tile_256": list(k_blocks.gemm_tile(256))}}


def print_table(result: dict) -> None:
    tokens = result["tokens"]
    print(f"\ngguf_matmul vs bf16 F.linear on {result['device']} (x bf16; per T: us, weight GB/s, speed-up vs bf16; "
          f"T <= {result['tiles']['gemv_max_rows']}: GEMV)")
    head = f"{'type':6s} {'shape':8s} {'N x K':>12s} {'MB':>7s}"
    print(head + "".join(f" | {'T=' + str(t):>20s}" for t in tokens) + "  check")
    rows: dict[tuple[str, str], dict[int, dict]] = {}
    for r in result["results"]:
        rows.setdefault((r["type"], r["shape"]), {})[r["t"]] = r
    for shape, (n, k) in result["shapes"].items():
        if shape in result["bf16"]:
            cells = result["bf16"][shape]
            print(f"{'bf16':6s} {shape:8s} {f'{n}x{k}':>12s} {n * k * 2 / 1e6:7.1f}" + "".join(
                f" | {cells[str(t)]['us']:8.1f} {cells[str(t)]['gb_s']:5.0f}      " if str(t) in cells
                else f" | {'':20s}" for t in tokens))
        for qtype in result["types"]:
            cells = rows.get((qtype, shape))
            if not cells:
                continue
            weight_mb = next(iter(cells.values()))["weight_bytes"] / 1e6
            errors = result["checks"].get(f"{qtype} {shape}", {})
            verdict = "FAIL" if any(e > CHECK_TOLERANCE for e in errors.values()) else "ok"
            print(f"{qtype:6s} {shape:8s} {f'{n}x{k}':>12s} {weight_mb:7.1f}" + "".join(
                f" | {cells[t]['us']:8.1f} {cells[t]['gb_s']:5.0f} {cells[t]['speedup']:4.2f}x" if t in cells
                else f" | {'':20s}" for t in tokens) + f"  {verdict} {max(errors.values(), default=0):.1e}")
    print("\ngeometric mean speed-up vs bf16 over the shapes")
    print(f"{'type':6s}" + "".join(f" {'T=' + str(t):>7s}" for t in tokens))
    for qtype in result["types"]:
        line = f"{qtype:6s}"
        for t in tokens:
            ups = [r["speedup"] for r in result["results"] if r["type"] == qtype and r["t"] == t]
            line += f" {math.exp(sum(map(math.log, ups)) / len(ups)):6.2f}x" if ups else f" {'':7s}"
        print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU rehearsal: Triton's interpreter, tiny shapes, 1 call")
    ap.add_argument("--types", default=",".join(TYPES), help="comma-separated GGML types")
    ap.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default all)")
    ap.add_argument("--tokens", help="comma-separated rows of x (default 1,4,8,64,256)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with dequantize-then-matmul")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.tiny:   # Triton reads it when a kernel is decorated, k_blocks when it is imported: before the imports
        os.environ["TRITON_INTERPRET"] = "1"

    import torch
    import torch.nn.functional as F
    import triton

    from cvllm_gguf.kernels import gguf_matmul, has_kernel
    from cvllm_gguf.quant_types import GGMLType

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: use --tiny for the CPU rehearsal")
    all_shapes = TINY_SHAPES if args.tiny else SHAPES
    shapes = {name: all_shapes[name] for name in args.shapes.split(",")} if args.shapes and not args.tiny \
        else all_shapes
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(TINY_TOKENS if args.tiny else TOKENS)
    names = [name.strip().upper() for name in args.types.split(",")]
    unknown = [name for name in names if name not in GGMLType.__members__]
    if unknown:
        ap.error(f"unknown GGML type {', '.join(unknown)}")
    qtypes = [GGMLType[name] for name in names]
    missing = [q.name for q in qtypes if not has_kernel(q)]
    if missing:
        ap.error(f"no gguf_matmul kernel for {', '.join(missing)}")
    bench_us = timer(args.tiny, args.warmup, args.rep)
    gen = torch.Generator(device=device).manual_seed(0)

    result: dict = {
        "bench": "gguf_kernels", "command": "python " + " ".join(sys.argv), "commit": git_commit(),
        "device": torch.cuda.get_device_name() if device == "cuda"
        else f"cpu {platform.machine()} (Triton interpreter)",
        "tiny": args.tiny, "torch": torch.__version__, "triton": triton.__version__, "x_dtype": "bfloat16",
        "timing": "host clock, one call (meaningless)" if args.tiny else
                  f"triton.testing.do_bench median (warmup {args.warmup} ms, rep {args.rep} ms), L2 cleared per call",
        "tiles": tile_defaults(), "types": [q.name for q in qtypes], "shapes": {k: list(v) for k, v in shapes.items()},
        "tokens": tokens, "check_rows": CHECK_ROWS, "check_tolerance": CHECK_TOLERANCE, "bf16": {}, "results": [],
        "checks": {}, "gpu": {},
    }

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))

    started = time.perf_counter()
    with GpuSampler() as sampler:
        for shape, (n, k) in shapes.items():
            xs = {t: torch.randn(t, k, device=device, dtype=torch.bfloat16, generator=gen) for t in tokens}
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
            bf16 = result["bf16"][shape] = {}
            for t in tokens:
                us = bench_us(lambda x=xs[t], w=w: F.linear(x, w))
                bf16[str(t)] = {"us": us, "gb_s": w.numel() * 2 / us / 1e3, "tflop_s": 2 * t * n * k / us / 1e6}
            del w
            for qtype in qtypes:
                qweight = random_blocks(qtype, n, k, device, gen)
                if not args.no_check:
                    errors = check(qtype, qweight, k, tokens, device, gen)
                    result["checks"][f"{qtype.name} {shape}"] = {str(t): e for t, e in errors.items()}
                for t in tokens:
                    us = bench_us(lambda x=xs[t], qw=qweight, q=qtype, n=n, k=k: gguf_matmul(x, qw, q, n, k))
                    result["results"].append({
                        "type": qtype.name, "shape": shape, "n": n, "k": k, "t": t,
                        "path": "gemv" if t <= result["tiles"]["gemv_max_rows"] else "gemm", "us": us,
                        "weight_bytes": qweight.numel(), "gb_s": qweight.numel() / us / 1e3,
                        "tflop_s": 2 * t * n * k / us / 1e6, "bf16_us": bf16[str(t)]["us"],
                        "speedup": bf16[str(t)]["us"] / us})
                del qweight
                result["elapsed_s"] = time.perf_counter() - started
                save()
                print(f"  {shape} {qtype.name} done ({result['elapsed_s']:.0f} s)", flush=True)
            if device == "cuda":
                torch.cuda.empty_cache()
    result["gpu"] = sampler.summary
    result["elapsed_s"] = time.perf_counter() - started
    save()
    print_table(result)


if __name__ == "__main__":
    main()
