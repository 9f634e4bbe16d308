"""Which activation dtype the CPU fast path should use with int4-packed weights, per CPU kind (issue 24, item 1):
torch's int4-packed matmul (``aten._weight_int4pack_mm_for_cpu``, the GGUF Q4 linears' and the quantized LM head's)
over one demo-model layer's four linears, with bf16, float16 and float32 activations, next to a dense bf16 matmul of
the same shapes (what a dequantized copy would cost).

    python bench/cpu_dtype_by_kind.py --json out.json                      # this CPU's kernels
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/cpu_dtype_by_kind.py --json out.json  # AVX2

Prints ms per layer (median of ``--reps`` timed calls after warm-up), with the capability torch dispatched to and the
load average.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import git_commit  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # demo layer: qkv, o, gate_up, down ([N, K])


def median_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return sorted(times)[reps // 2] * 1e3


def layer_ms(dtype: torch.dtype, rows: int, reps: int, packed: bool) -> float:
    total = 0.0
    for n, k in SHAPES:
        x = torch.randn(rows, k).to(dtype)
        if packed:
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32),
                                                                        1)
            scales = (torch.rand(k // 32, n, 2) * 0.01).to(dtype)
            total += median_ms(lambda x=x, w=weight, s=scales: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, s),
                               reps)
        else:
            weight = torch.randn(n, k).to(dtype)
            total += median_ms(lambda x=x, w=weight: torch.nn.functional.linear(x, w), reps)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1, help="1: least disturbed by other work on a busy VM")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = {}
    for rows in (1, 16):
        for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32)):
            reps = args.reps if dtype == torch.bfloat16 else max(5, args.reps // 5)
            results[f"int4pack {name} rows={rows}"] = layer_ms(dtype, rows, reps, packed=True)
        results[f"dense bfloat16 rows={rows}"] = layer_ms(torch.bfloat16, rows, args.reps, packed=False)
    capability = torch.backends.cpu.get_cpu_capability()
    for key, ms in results.items():
        print(f"{capability:7} {key:28} {ms:8.3f} ms a layer")
    report = {"bench": "cpu_dtype_by_kind", "commit": git_commit(), "capability": capability,
              "command": f"python bench/cpu_dtype_by_kind.py --threads {args.threads}",
              "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ},
              "threads": args.threads, "load_before": load_before, "load_after": os.getloadavg(),
              "ms_per_layer": results}
    if args.json:
        path = Path(args.json)
        runs = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(runs + [report], indent=2) + "\n")   # one file, a run per CPU kind


if __name__ == "__main__":
    main()
