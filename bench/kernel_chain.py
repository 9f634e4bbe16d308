"""What one more dependent kernel costs a decode step on the GPU: chains of N launches captured in a CUDA graph and
replayed, microseconds a launch, with programmatic dependent launch (PDL, pdl.py) on and off.

A batch-1 step of Llama-3-8B is ~290 kernels in a row, each waiting for the one before (a norm, four GEMVs, rotary,
attention and its combine, the gated activation, a layer). This measures the floor under each: an empty kernel of 1,
one per SM and 8 per SM programs; one whose programs read 16 bytes the kernel before wrote and write 16 (a real data
dependence: one L2 round trip); and the backend's RMSNorm of one 4096-wide row (the step's 65 norms).

    python bench/kernel_chain.py [--length 200] [--json FILE]     # on the GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from common import captured_us, command_line, git_commit  # noqa: E402

from cvllm_cuda.kernels import gpu, pdl  # noqa: E402
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel  # noqa: E402
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm  # noqa: E402


@triton.jit
def _empty_kernel(x_ptr, USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)


@triton.jit
def _relay_kernel(src_ptr, dst_ptr, USE_PDL: tl.constexpr):
    """16 bytes a program from ``src`` (the previous launch's output) to ``dst``."""
    wait_for_previous_kernel(USE_PDL)
    offsets = tl.program_id(0) * 4 + tl.arange(0, 4)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets) + 1)


def per_launch_us(launch, length: int) -> float:
    """Microseconds a launch: ``length`` calls of ``launch(i)`` captured in one graph (common.captured_us: the median
    replay, over ``length``). (Session 43's figures took the mean of 20 replays instead.)"""
    return captured_us(lambda: [launch(i) for i in range(length)], per=length)


def chains(length: int, use_pdl: bool) -> dict[str, float]:
    device = torch.device("cuda")
    launch = pdl.options(device) if use_pdl else {"USE_PDL": False}
    sms = gpu.num_sms(gpu.device_index(device))
    results = {}
    for programs in (1, sms, 8 * sms):
        x = torch.zeros(4 * programs, dtype=torch.int32, device=device)
        results[f"empty, {programs} programs"] = per_launch_us(
            lambda i, x=x, programs=programs: _empty_kernel[(programs,)](x, **launch), length)
        buffers = [torch.zeros(4 * programs, dtype=torch.int32, device=device) for _ in range(2)]
        results[f"relay 16 B a program, {programs} programs"] = per_launch_us(
            lambda i, b=buffers, programs=programs: _relay_kernel[(programs,)](b[i % 2], b[1 - i % 2], **launch),
            length)
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device=device)
    residual, weight = torch.randn_like(x), torch.ones(4096, dtype=torch.bfloat16, device=device)
    if use_pdl:
        results["fused_add_rms_norm, 1 x 4096"] = per_launch_us(
            lambda i: fused_add_rms_norm(x, residual, weight, 1e-5), length)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=200, help="launches a graph")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    table = {}
    for use_pdl in (True, False):
        for name, us in chains(args.length, use_pdl).items():
            table[f"{name}, PDL {'on' if use_pdl else 'off'}"] = round(us, 2)
    gpu_name = torch.cuda.get_device_name()
    print(f"a chain of {args.length} dependent launches in a CUDA graph on {gpu_name}, us a launch:")
    for name, us in table.items():
        print(f"  {us:7.2f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "kernel_chain", "gpu": gpu_name, "length": args.length, "command": command_line(),
                       "commit": git_commit(), "us_a_launch": table}, f, indent=1)


if __name__ == "__main__":
    main()
