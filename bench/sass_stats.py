"""What a Triton kernel compiles to on Hopper, without a GPU: registers, shared memory, layout conversions (each a
shared-memory round trip, a barrier if inside a loop) and the SASS instruction mix of its main loop. Triton compiles
for sm_90 on any machine (ptxas and nvdisasm ship with it); device time is then spent only on what needs timing.

    python bench/sass_stats.py int8-gemv --layout q4_k --config 32,64,4,3 [--block-m ROWS]
    python bench/sass_stats.py float-gemv --layout gptq4_g128 --config 32,32,4,3 --dump /tmp/sass
    python bench/sass_stats.py mma-gemv --layout gptq4_g128 --config 4,1 [--block-m ROWS]   # warps, stages[, words]
    python bench/sass_stats.py gemm --layout q6_k --config 128,8,4,4 --block-m 64
    python bench/sass_stats.py gemm --table     # the GEMM's default tiles: every layout, every row tile
    python bench/sass_stats.py gemm-swapped --layout q4_k --config 64,8,4,4 --block-m 64

The runtime's specialisations are reproduced (16-byte aligned pointers, N/K/splits divisible by 16), so the layouts
match what a launch compiles. Output: one line of totals, then the loop's instructions by opcode.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

import torch

from cvllm_cuda.kernels import quant_gemm_swapped, quant_gemv, quant_gemv_int8, quant_gemv_mma, quant_matmul
from cvllm_cuda.kernels.quant_tiles import group_words, groups_in_thread
from cvllm_cuda.quant_planes import QuantLayout

sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))
import sm90  # noqa: E402
from test_quant_matmul import LAYOUTS as TEST_LAYOUTS  # noqa: E402

from cvllm_gguf.planes import LAYOUTS as GGUF_LAYOUTS  # noqa: E402

# the tests' layouts, and the GGUF types they lack (q4_0, q5_1, q5_k: every high-plane width of the int8 GEMV)
LAYOUTS = {**{qtype.name.lower(): layout for qtype, layout in GGUF_LAYOUTS.items()}, **TEST_LAYOUTS}

SHARED_LIMIT = 232448   # bytes of shared memory a block may have on the H200 (sm_90)
PLANES = {"low_ptr": "*i32", "high_ptr": "*i32", "d_ptr": "*fp16", "m_ptr": "*fp16", "a_ptr": "*u8", "b_ptr": "*u8"}
DIVISIBLE = {"N", "K", "SPLIT_WORDS", "one_bits", "stride_xt", "stride_ot"}   # (T: not divisible)


def kernel_spec(kind: str, layout: QuantLayout, config: tuple[int, ...], block_m: int = 16):
    """(jit function, signature, constexprs, num_warps) of one GEMV (or GEMM: ``block_m``, the rows' tile; the int8
    GEMV: the rows of x a program takes) configuration."""
    if kind == "mma-gemv":   # quant_gemv_mma._gemv_mma_kernel: (warps, stages[, words a lane]); rows: up to 16
        warps, stages, *words = config
        signature = {"x_ptr": "*i32", "out_ptr": "*bf16", "partial_ptr": "*fp32", "counters_ptr": "*i32", **PLANES,
                     "N": "i32", "K": "i32", "T": "i32", "stride_ot": "i32", "SPLIT_WORDS": "i32"}
        mma = {**layout.kernel_args(), "KU": quant_gemv_mma.group_units(layout), "W": warps,
               "FW": words[0] if words else quant_gemv_mma.tile(block_m)[0], "TG": -(-block_m // 8),
               "STAGES": stages, "EVEN_N": True, "INTERPRET": False, "USE_PDL": False}
        return quant_gemv_mma._gemv_mma_kernel, signature, mma, warps
    block_n, block_w, warps, *stages = config
    gw = quant_gemv_int8.int8_group_words(layout, block_w) if kind == "int8-gemv" else group_words(layout, block_w)
    common = {**layout.kernel_args(), "BLOCK_N": block_n, "BLOCK_W": block_w, "GROUP_WORDS": gw,
              "GROUP_SUM": groups_in_thread(block_n, block_w, gw, warps), "STAGES": stages[0] if stages else 1,
              "EVEN": True, "INTERPRET": False, "USE_PDL": False}
    if kind == "int8-gemv":
        signature = {"packs_ptr": "*i32", "xd_ptr": "*fp32", "xsum_ptr": "*fp32", "xblock_sum_ptr": "*fp32",
                     "out_ptr": "*bf16", "partial_ptr": "*fp32", **PLANES,
                     "N": "i32", "K": "i32", "SPLIT_WORDS": "i32", "T": "i32", "stride_ot": "i32"}
        return quant_gemv_int8._gemv_int8_kernel, signature, {**common, "ROWS": block_m}, warps
    if kind in ("gemm", "gemm-per-position"):   # quant_matmul._gemm_kernel: (BLOCK_N, BLOCK_W, warps, stages)
        signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", **PLANES, "T": "i32", "N": "i32", "K": "i32",
                     "stride_xt": "i32", "stride_ot": "i32", "SPLIT_WORDS": "i32"}
        gemm = {**layout.kernel_args(), "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_W": block_w,
                "UNPACKED": kind == "gemm", "IEEE": False, "UPCAST": False, "USE_PDL": False}
        return quant_matmul._gemm_kernel, signature, gemm, warps
    if kind == "gemm-swapped":   # quant_gemm_swapped._gemm_swapped_kernel: (BLOCK_N, BLOCK_W, warps, stages)
        signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "counters_ptr": "*i32",
                     **PLANES, "T": "i32", "N": "i32", "K": "i32", "stride_xt": "i32", "stride_ot": "i32",
                     "SPLIT_WORDS": "i32"}
        swapped = {**layout.kernel_args(), "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_W": block_w,
                   "IEEE": False, "UPCAST": False, "LANES": quant_gemm_swapped.in_lanes(layout, torch.bfloat16),
                   "ASM": True, "USE_PDL": False, "GROUP_WORDS": group_words(layout, block_w)}
        return quant_gemm_swapped._gemm_swapped_kernel, signature, swapped, warps
    signature = {"x_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", **PLANES,
                 "N": "i32", "K": "i32", "SPLIT_WORDS": "i32", "one_bits": "i32"}
    return quant_gemv._gemv_kernel, signature, common, warps


def compile_sm90(fn, signature: dict, constexprs: dict, warps: int, stages: int | None = None):
    return sm90.compile_sm90(fn, signature, constexprs, warps, stages, DIVISIBLE)


def gemm_table() -> None:
    """The GEMM's default tiles (quant_matmul.GEMM_CONFIGS) for every test layout and row tile: shared memory, and
    whether a block fits the H200 (else quant_gemm falls back to the per-position kernel). These figures equal the
    H200's own compile (q4_k (64, 32, 4, 3) at 128 rows: 270,336 B both, 2026-12-03)."""
    for name, layout in LAYOUTS.items():
        for block_m in (16, 32, 64, 128):
            config = quant_matmul.GEMM_CONFIGS[layout.low_bits]
            try:
                fn, signature, constexprs, warps = kernel_spec("gemm", layout, config, block_m)
                kernel = compile_sm90(fn, signature, constexprs, warps, config[3])
                shared = kernel.metadata.shared
                print(f"{name:13s} BLOCK_M {block_m:3d} {config}: {shared} B shared: "
                      f"{'fits' if shared <= SHARED_LIMIT else 'OUT OF SHARED MEMORY'}", flush=True)
            except Exception as exc:   # a compile error: quant_gemm falls back too
                print(f"{name:13s} BLOCK_M {block_m:3d} {config}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


def main_loop(lines: list[str]) -> list[str]:
    """The SASS lines of the largest loop: from a label to the furthest branch back to it (the whole listing if
    there is no backward branch). The first two branches bounded the loop of the GEMVs but not of the GEMM, whose
    pipelined prologue branches first."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := re.search(r"\bBRA\b.*?(\.L_x_\d+)", line)) and labels.get(m.group(1), i) < i]
    if not loops:
        return lines
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return lines[first:last + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["int8-gemv", "float-gemv", "mma-gemv", "gemm", "gemm-per-position",
                                         "gemm-swapped"])
    ap.add_argument("--block-m", type=int, help="the GEMMs' row tile (default 16); int8-gemv: rows a program "
                    "takes (default 1)")
    ap.add_argument("--table", action="store_true", help="gemm: the default tiles, every layout and row tile")
    ap.add_argument("--layout", default="q4_k", choices=sorted(LAYOUTS))
    ap.add_argument("--config", default="32,64,4,3", help="BLOCK_N,BLOCK_W,WARPS[,STAGES] (mma-gemv: WARPS,STAGES)")
    ap.add_argument("--dump", type=Path, help="write the TTGIR, PTX and SASS here")
    args = ap.parse_args()
    if args.table:
        gemm_table()
        return
    config = tuple(int(v) for v in args.config.split(","))
    stages = config[3] if args.kind.startswith("gemm") and len(config) > 3 else None
    block_m = args.block_m or (1 if args.kind in ("int8-gemv", "mma-gemv") else 16)
    kernel = compile_sm90(*kernel_spec(args.kind, LAYOUTS[args.layout], config, block_m), stages)
    dump = args.dump or Path(f"/tmp/sass-{args.kind}")
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "kernel.cubin").write_bytes(kernel.asm["cubin"])
    for ext in ("ttgir", "ptx"):
        (dump / f"kernel.{ext}").write_text(kernel.asm[ext])
    sass = subprocess.run([sm90.tool("nvdisasm"), "-c", str(dump / "kernel.cubin")], capture_output=True, text=True,
                          check=True).stdout
    (dump / "kernel.sass").write_text(sass)
    lines = sass.splitlines()
    body = main_loop(lines)
    ops = collections.Counter(m.group(1).split(".")[0] for line in body
                              if (m := re.match(r"\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]*)", line)))
    print(f"{args.kind} {args.layout} {config}: {sm90.registers(kernel)} registers, "
          f"{kernel.metadata.shared} B shared, {kernel.asm['ttgir'].count('convert_layout')} layout conversions, "
          f"{sum(ops.values())} SASS instructions in the loop, {sum('BAR' in line for line in body)} barriers there "
          f"(files in {dump})")
    for op, count in ops.most_common(16):
        print(f"  {count:5d} {op}")


if __name__ == "__main__":
    main()
