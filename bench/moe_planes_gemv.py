"""The decode-step MoE over low-bit experts: the expert GEMVs (cvllm_cuda/kernels/moe_planes_gemv.py) against the
grouped planes GEMM (fused_moe_planes.py) on Qwen3-30B-A3B's expert shapes (hidden 2048, moe intermediate 768, 128
experts, top-8), in the Q4_K / Q4_K_M / GPTQ-4bit layouts the GGUF and GPTQ loaders make.

    python bench/moe_planes_gemv.py --json $OUT/moe_planes_gemv.json      # on the H200 (~1 min; --sweep: tiles too)
    python bench/moe_planes_gemv.py --compile-only                         # any machine: sm_90 registers, shared

Each measurement is a CUDA graph of the MoE layer over LAYERS distinct layers' experts (back to back, PDL on, the
weights never in L2), replayed and timed with CUDA events: microseconds a layer, and the routed experts' bytes (the
planes and factors of k experts' gate, up and down) over that time. ``--compile-only`` compiles both kernels for
sm_90 the way a launch specialises them (bench/sass_stats.py's approach) and prints their registers, shared memory
and layout conversions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cvllm_cuda.kernels import fused_moe_planes as planes_module
from cvllm_cuda.kernels import moe_planes_gemv as gemv_module
from cvllm_cuda.kernels.activation import silu_and_mul
from cvllm_cuda.kernels.moe_planes_gemv import PlanesGemvTiles, moe_planes_gemv
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
LAYERS = 8
Q4_K = QuantLayout(4, 0, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True, int8_activations=True)
Q6_K = QuantLayout(4, 2, 16, 256, a_mode=1, b_mode=1, b_const=-32)
GPTQ4 = QuantLayout(4, 0, 128, 128, b_mode=2, b_const=-1)
CASES = {   # gate_up parts' layouts (one [2I, H] part: GGUF's fused form), down's layout, act-order perms
    "q4_k": ([Q4_K], Q4_K, False),
    "q4_k_m": ([Q4_K], Q6_K, False),          # Q4_K_M's down in Q6_K (about half its layers)
    "gptq4_g128": ([GPTQ4, GPTQ4], GPTQ4, False),
    "gptq4_g128_act": ([GPTQ4, GPTQ4], GPTQ4, True),
}


def random_planes(layout: QuantLayout, n: int, k: int, device: str = "cuda") -> QuantWeight:
    """Stacked planes of EXPERTS experts: random words, small factors (only finite sums matter for timing)."""
    def words(bits):
        return torch.randint(-(1 << 31), 1 << 31, (EXPERTS, k * bits // 32, n), dtype=torch.int32, device=device)

    def half(rows):
        return (torch.rand(EXPERTS, rows, n, device=device) * 1e-3).half()

    def byte(dtype):
        return torch.randint(0, 64, (EXPERTS, k // layout.scale_group, n), device=device).to(dtype)

    return QuantWeight(layout, n, k, words(layout.low_bits), words(layout.high_bits) if layout.high_bits else None,
                       half(k // layout.super_group), half(k // layout.super_group) if layout.has_m else None,
                       byte(torch.int8 if layout.a_mode == 1 else torch.uint8) if layout.a_mode else None,
                       byte(torch.uint8) if layout.b_mode == 2 else None)


def make_layer(name: str, device: str = "cuda"):
    gate_up_layouts, down_layout, act_order = CASES[name]
    rows = 2 * INTER // len(gate_up_layouts)
    parts = [random_planes(lay, rows, HIDDEN, device) for lay in gate_up_layouts]
    down = random_planes(down_layout, HIDDEN, INTER, device)
    perms = None
    if act_order:
        perms = [torch.argsort(torch.rand(EXPERTS, k, device=device), dim=1).int()
                 for k in [HIDDEN] * len(parts) + [INTER]]
    return parts, down, perms


def tiles_to_try():
    yield PlanesGemvTiles()
    for n, w, warps in itertools.product((16, 32, 64), (16, 32, 64), (2, 4, 8)):
        yield PlanesGemvTiles(gate_up_n=n, gate_up_w=w, gate_up_warps=warps)
    for n, w, warps in itertools.product((8, 16, 32), (8, 16, 32), (2, 4, 8)):
        yield PlanesGemvTiles(down_n=n, down_w=w, down_warps=warps)


def bench(name: str, tokens: int, sweep: bool, results: list) -> None:
    from common import captured_us

    layers = [make_layer(name) for _ in range(LAYERS)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    ids = [torch.stack([torch.randperm(EXPERTS, device="cuda", generator=gen)[:TOP_K] for _ in range(tokens)])
           for _ in range(LAYERS)]
    weights = torch.rand(tokens, TOP_K, device="cuda", generator=gen)
    parts, down, _ = layers[0]
    routed_bytes = len({int(e) for e in ids[0].flatten()}) * (sum(p.nbytes() for p in parts) + down.nbytes()) / EXPERTS

    def stack(fn):
        return lambda: [fn(hidden, p, d, weights, ids[i], perms) for i, (p, d, perms) in enumerate(layers)]

    def report(label: str, us: float, **extra) -> None:
        print(f"{name} T={tokens}: {label:9s} {us:6.1f} us/layer ({routed_bytes / us / 1e6:.2f} TB/s)"
              f"{'  ' + extra['tiles'] if extra else ''}")
        results.append({"case": name, "tokens": tokens, "kernel": label, "us": us, **extra})

    saved = planes_module.PAIR_GEMV_MAX
    planes_module.PAIR_GEMV_MAX = 0
    try:
        report("grouped", captured_us(stack(lambda h, p, d, w, i, pm: planes_module.fused_moe_planes(
            h, p, d, w, i, silu_and_mul, pm)), LAYERS))
    finally:
        planes_module.PAIR_GEMV_MAX = saved
    timed = []
    for tiles in tiles_to_try() if sweep else [PlanesGemvTiles()]:
        us = captured_us(stack(lambda *a, t=tiles: moe_planes_gemv(*a, tiles=t)), LAYERS)
        timed.append((us, tiles))
    timed.sort(key=lambda item: item[0])
    for us, tiles in timed[:6]:
        report("gemv", us, tiles=repr(tiles))


def compile_sm90(fn, args: dict, warps: int):
    """``args``: the kernel's arguments by name as a launch passes them; a tensor's pointer and an int that 16
    divides are specialised as a launch does (16-byte aligned, divisible)."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(fn.params, args.values())):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + {torch.int32: "i32", torch.int64: "i64", torch.bfloat16: "bf16",
                                     torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                                     torch.int8: "i8"}[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


class _Capture:
    """Stands in for a kernel's ``[grid](...)``: records the launch's arguments instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def compile_only(names: list[str]) -> None:
    """Both kernels of each case compiled for sm_90 with the default tiles, from the arguments moe_planes_gemv
    passes (captured on the CPU, bf16 activations)."""
    nvbin = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin"
    for name in names:
        parts, down, perms = make_layer(name, "cpu")
        hidden = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
        ids = torch.arange(TOP_K).view(1, TOP_K)
        kernels = {kernel: getattr(gemv_module, kernel) for kernel in ("_gate_up", "_down")}
        captures = {kernel: _Capture() for kernel in kernels}
        try:
            for kernel, capture in captures.items():
                setattr(gemv_module, kernel, capture)
            moe_planes_gemv(hidden, parts, down, torch.rand(1, TOP_K), ids, perms)
        finally:
            for kernel, fn in kernels.items():
                setattr(gemv_module, kernel, fn)
        for kernel, fn in kernels.items():
            (args, kwargs), = captures[kernel].launches
            launch = {k: v for k, v in kwargs.items() if k not in ("num_warps", "enable_fp_fusion", "launch_pdl")}
            by_name = {**dict(zip(fn.arg_names, args)), **launch}
            compiled = compile_sm90(fn, {name: by_name[name] for name in fn.arg_names}, kwargs["num_warps"])
            with tempfile.TemporaryDirectory() as tmp:
                cubin = Path(tmp) / "kernel.cubin"
                cubin.write_bytes(compiled.asm["cubin"])
                usage = subprocess.run([str(nvbin / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                                       capture_output=True, text=True, check=True).stdout
            regs = re.search(r"REG:(\d+)", usage)
            print(f"{name} {kernel}: {regs.group(1) if regs else '?'} registers, {compiled.metadata.shared} B shared, "
                  f"{compiled.asm['ttgir'].count('convert_layout')} layout conversions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs (each kernel's in turn)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.compile_only:
        compile_only(args.cases.split(","))
        return
    results = []
    for name in args.cases.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            bench(name, tokens, args.sweep, results)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
