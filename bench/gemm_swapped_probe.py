"""Probe (issue 18): the decode-batch low-bit GEMM with the weight as wgmma's register operand.

Today's GEMM (quant_matmul._gemm_kernel, unpacked) computes out = x @ W^T with the unpacked weight tile as the second
``tl.dot`` operand, which Hopper's wgmma reads from shared memory: every K step stores the bf16 tile there (64 STS
a 64-element step, then a wgmma and a wait for it before the next unpack; q4_k (128, 8, 4, 4) at 64 rows compiled
for sm_90). Swapped, out^T = W @ x^T: the weight tile is the first operand, which wgmma takes from registers, so it
is unpacked straight into them, and x goes through shared memory instead, by asynchronous copies. That needs each
element position's slice of x contiguous: x position-major, x[t, S * K/P + w] = input w * P + S (P elements a word;
one permute a call, here a torch copy). Compiled for sm_90 on a CPU (2026-12-04): no STS, 8.6k instead of 9.9k loop
instructions per 1k elements of a 128-column tile (q4_k, 64 rows); the unpack's ~4.5 instructions an element stay,
so what this would gain is the shared-memory round trip, not the ALU work. Unmeasured on a GPU so far.

    python bench/gemm_swapped_probe.py --json $OUT/gemm_swapped_probe.json      # on the H200 (~2 min)
    TRITON_INTERPRET=1 python bench/gemm_swapped_probe.py --check-only            # the numbers, on a CPU
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
sys.path.insert(0, str(Path(__file__).parent.parent / "plugins/backend-cuda/tests"))
from quant_gemm_rows import SHAPES, planes_on_gpu  # noqa: E402

from cvllm_cuda.kernels.pdl import wait_for_previous_kernel  # noqa: E402
from cvllm_cuda.kernels.quant_tiles import dot_into, load_words, quant_element, word_factors  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (BLOCK_N, BLOCK_W at 4-bit, warps, stages); BLOCK_M follows the rows (16, 64, 128)
CONFIGS = [(128, 16, 4, 4), (128, 32, 4, 3), (64, 32, 4, 3), (128, 16, 8, 3), (64, 16, 4, 4)]


@triton.jit(do_not_specialize=["T"])
def _gemm_swapped_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, T, N, K, stride_xt,
                         stride_ot, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                         SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                         HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr):
    """out^T tile [BLOCK_N, BLOCK_M] += W tile [BLOCK_N, BLOCK_W words] @ x^T, one dot per element position S of
    the words; x position-major (above)."""
    wait_for_previous_kernel(USE_PDL)
    PER_WORD: tl.constexpr = 32 // LOW_BITS
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ts = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    t_ok = ts < T
    num_words = K // PER_WORD
    x_cols = x_ptr + ts.to(tl.int64)[None, :] * stride_xt
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for w0 in range(0, num_words, BLOCK_W):
        words = w0 + tl.arange(0, BLOCK_W)
        word_ok = words < num_words
        ok = col_ok[:, None] & word_ok[None, :]
        first = (words * PER_WORD)[None, :]
        low, high = load_words(low_ptr, high_ptr, words[None, :], cols[:, None], ok, N, LOW_BITS, HIGH_BITS)
        scale, offset = word_factors(d_ptr, m_ptr, a_ptr, b_ptr, first, cols[:, None], ok, N, SCALE_GROUP,
                                      SUPER_GROUP, A_MODE, B_MODE, B_CONST, HAS_M)
        for S in tl.static_range(PER_WORD):
            x = tl.load(x_cols + (S * num_words + words)[:, None], mask=word_ok[:, None] & t_ok[None, :], other=0.0)
            w = (quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset).to(x.dtype)
            acc = dot_into(w, x, acc, IEEE, UPCAST)
    out_ptrs = out_ptr + ts.to(tl.int64)[None, :] * stride_ot + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & t_ok[None, :])


def swapped_gemm(x: torch.Tensor, weight, out: torch.Tensor, config: tuple) -> None:
    """out = x @ W^T for x [T, K] (T rows of a decode batch), through the swapped kernel."""
    from cvllm_cuda.kernels.pdl import options as pdl_options
    from cvllm_cuda.kernels.quant_tiles import kernel_tensors, upcast
    lay = weight.layout
    t, k = x.shape
    per_word = 32 // lay.low_bits
    x_pos = x.view(t, k // per_word, per_word).transpose(1, 2).contiguous().view(t, k)
    block_n, block_w, warps, stages = config
    block_m = 16 if t <= 16 else 64 if t <= 64 else 128
    grid = (triton.cdiv(weight.out_features, block_n), triton.cdiv(t, block_m))
    _gemm_swapped_kernel[grid](x_pos, out, *kernel_tensors(weight), t, weight.out_features, k, x_pos.stride(0),
                               out.stride(0), **lay.kernel_args(), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_W=max(1, block_w * lay.low_bits // 4), IEEE=x.dtype == torch.float32,
                               UPCAST=upcast(x.dtype), num_warps=warps, num_stages=stages, **pdl_options(x.device))


def check(names: list[str]) -> dict:
    """Each layout's relative max error against float32 on a small weight, at a few row counts."""
    from test_quant_matmul import LAYOUTS, random_weight

    from cvllm_cuda.quant_planes import dequantize_planes
    errors = {}
    n0, k0 = (1024, 4096) if DEV == "cuda" else (128, 512)
    for name in names:
        weight = random_weight(LAYOUTS[name], n0, k0, DEV, seed=1)
        ref_w = dequantize_planes(weight).T.float()
        worst = 0.0
        for t in (2, 16, 40) if DEV == "cpu" else (2, 16, 64, 128):
            x = torch.randn(t, k0, device=DEV, dtype=torch.bfloat16)
            out = torch.empty(t, n0, device=DEV, dtype=torch.bfloat16)
            swapped_gemm(x, weight, out, CONFIGS[0] if DEV == "cuda" else (64, 8, 4, 1))
            ref = x.float() @ ref_w
            worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
        errors[name] = worst
        print(f"{name}: max error {worst:.2e} of the largest output", flush=True)
        assert worst < 2e-2, (name, worst)
    return errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="q4_k,q8_0,gptq4_g128,q6_k")
    ap.add_argument("--rows", default="16,64,128")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.layouts.split(",")
    result = {"bench": "gemm_swapped_probe", "command": "python " + " ".join(sys.argv), "errors": check(names)}
    if args.check_only:
        return
    from common import captured_us, git_commit
    from test_quant_matmul import LAYOUTS

    from cvllm_cuda.kernels.quant_matmul import quant_gemm
    result.update(commit=git_commit(), gpu=torch.cuda.get_device_name(), us_per_layer={})
    for name in names:
        layers = [{s: planes_on_gpu(LAYOUTS[name], n, k) for s, (n, k) in SHAPES.items()} for _ in range(2)]
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k, device=DEV, dtype=torch.bfloat16) for _, k in SHAPES.values()}
            outs = {n: torch.empty(rows, n, device=DEV, dtype=torch.bfloat16) for n, _ in SHAPES.values()}

            def stack(gemm, xs=xs, outs=outs, layers=layers):
                return lambda: [gemm(xs[k], layer[s], outs[n]) for layer in layers for s, (n, k) in SHAPES.items()]

            row = {"today's default": captured_us(stack(quant_gemm), per=2)}
            for config in CONFIGS:
                try:
                    row[str(config)] = captured_us(stack(lambda x, w, o, c=config: swapped_gemm(x, w, o, c)), per=2)
                except Exception as exc:   # out of shared memory or registers
                    print(f"  {name} {rows} rows {config}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            result["us_per_layer"][f"{name} x {rows}"] = row
            best = min((v, k) for k, v in row.items() if k != "today's default") if len(row) > 1 else (None, None)
            print(f"{name:11s} {rows:4d} rows: today {row[next(iter(row))]:7.1f} us a layer, swapped best "
                  f"{best[0] or float('nan'):7.1f} {best[1]}", flush=True)
        del layers
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
