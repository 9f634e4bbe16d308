"""Probe (issue 18): would a row-major 4-bit plane stream faster at batch 1 than today's K-major one?

Today's planes are [K / 8, N] int32 (output features contiguous, GPTQ's layout) and the int8-activation GEMV reads
tiles of [words, 32 output features]: Q4_K runs at ~2.25 TB/s in a stack of Llama-3-8B layers, while the bf16
Triton GEMV, which reads whole weight rows ([N, K], K contiguous, a few rows a program, no K split), streams ~4.1.
The dot-product work per byte is about the same, so the access pattern is the suspect. This probe runs a Q4_K-like
GEMV over a row-major plane ([N, K / 8] int32, one 32-input block = 4 words = one 16-byte load per thread; factors
[N, K / 32] uint8 and [N, K / 256] f16, also row-major), with the same int8 activations (quant_gemv_int8's
quantizer), timed like quant_gemv_stack.py (each shape alone, 8 layers in one CUDA graph) next to the K-major
kernel and bf16, after checking its output against a float32 reference.

    python bench/rowmajor_gemv_probe.py --json $OUT/rowmajor_probe.json        # on the H200 (~2 min)
    TRITON_INTERPRET=1 python bench/rowmajor_gemv_probe.py --check-only        # the numbers, on a CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from cvllm_cuda.kernels.int8_activations import quantize_activations
from cvllm_cuda.kernels.quant_gemv_int8 import _dot4

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _row_gemv_kernel(packs_ptr, xd_ptr, xsum_ptr, out_ptr, w_ptr, a_ptr, b_ptr, d_ptr, m_ptr, N, KW,
                     BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, STAGES: tl.constexpr, INTERPRET: tl.constexpr):
    """out[n] = sum over 32-input blocks g of d[n, g / 8] * a[n, g] * x_d[g] * sum(q * q_x) - m[n, g / 8] * b[n, g]
    * sum_x[g]: Q4_K's formula, each program BLOCK_N whole rows, a tile [BLOCK_N, GROUPS blocks, 4 words]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    groups = tl.arange(0, GROUPS)
    words4 = tl.arange(0, 4)
    w_ptrs = w_ptr + rows[:, None, None] * KW + groups[None, :, None] * 4 + words4[None, None, :]
    pack_ptrs = packs_ptr + (groups[:, None] * 4 + words4[None, :]) * 2                      # [GROUPS, 4]
    blocks_per_row = KW // 4
    # the factors and sums [BLOCK_N, GROUPS, 1], in the tile's own layout (no shared-memory round trip a step)
    acc = tl.zeros((BLOCK_N, GROUPS, 1), dtype=tl.float32)
    rows3 = rows[:, None, None]
    groups3 = groups[None, :, None]
    for g0 in tl.range(0, blocks_per_row, GROUPS, num_stages=STAGES):
        low = tl.load(w_ptrs)
        p0 = tl.load(pack_ptrs)[None, :, :]
        p1 = tl.load(pack_ptrs + 1)[None, :, :]
        dots = _dot4(low & 0x0F0F0F0F, p0 + tl.zeros_like(low), tl.zeros_like(low), INTERPRET)
        dots = _dot4((low >> 4) & 0x0F0F0F0F, p1 + tl.zeros_like(low), dots, INTERPRET)
        block = g0 + groups3
        factor = rows3 * blocks_per_row + block
        a = tl.load(a_ptr + factor).to(tl.float32)
        b = tl.load(b_ptr + factor).to(tl.float32)
        sup = rows3 * (blocks_per_row // 8) + block // 8
        d = tl.load(d_ptr + sup).to(tl.float32)
        m = tl.load(m_ptr + sup).to(tl.float32)
        x_d = tl.load(xd_ptr + block)
        x_sum = tl.load(xsum_ptr + block)
        acc += tl.sum(dots, axis=2, keep_dims=True).to(tl.float32) * (x_d * d * a) - m * b * x_sum
        w_ptrs += GROUPS * 4
        pack_ptrs += GROUPS * 8
    acc = tl.sum(acc, axis=2)
    tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


def random_rowmajor(n: int, k: int, device: str) -> dict[str, torch.Tensor]:
    return {"w": torch.randint(-(1 << 31), 1 << 31, (n, k // 8), dtype=torch.int32, device=device),
            "a": torch.randint(0, 64, (n, k // 32), device=device).to(torch.uint8),
            "b": torch.randint(0, 64, (n, k // 32), device=device).to(torch.uint8),
            "d": (torch.rand(n, k // 256, device=device) * 1e-3).half(),
            "m": (torch.rand(n, k // 256, device=device) * 1e-3).half()}


def row_gemv(x: torch.Tensor, weight: dict, out: torch.Tensor, config: tuple[int, int, int, int]) -> None:
    block_n, groups, warps, stages = config
    n, kw = weight["w"].shape
    packs, scales, _, block_sums = quantize_activations(x, 4)
    _row_gemv_kernel[(n // block_n,)](packs, scales, block_sums, out, weight["w"], weight["a"], weight["b"],
                                      weight["d"], weight["m"], n, kw, BLOCK_N=block_n, GROUPS=groups, STAGES=stages,
                                      INTERPRET=bool(triton.knobs.runtime.interpret), num_warps=warps)


def reference(x: torch.Tensor, weight: dict) -> torch.Tensor:
    """The weights dequantized (Q4_K's formula, float32 as the kernel forms them) times x rounded as the kernel rounds
    it, summed in float64 (a float32 matmul on a GPU may take TF32)."""
    from cvllm_cuda.kernels.int8_activations import dequantized_activations
    n, kw = weight["w"].shape
    shifts = torch.arange(8, device=x.device) * 4
    q = ((weight["w"].to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(n, kw * 8).float()
    a = weight["a"].float().repeat_interleave(32, 1)
    b = weight["b"].float().repeat_interleave(32, 1)
    d = weight["d"].float().repeat_interleave(256, 1)
    m = weight["m"].float().repeat_interleave(256, 1)
    w = q * d * a - m * b
    return (dequantized_activations(x).double()[0] @ w.double().t()).float()


def check(device: str, n: int = 256, k: int = 1024) -> float:
    torch.manual_seed(0)
    x = torch.randn(1, k, device=device, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    weight = random_rowmajor(n, k, device)
    out = torch.empty(n, device=device, dtype=torch.float32)
    row_gemv(x, weight, out, (4, 32, 4, 1))
    want = reference(x, weight)
    err = ((out - want).abs().max() / want.abs().max()).item()
    # compiled, the activation quantizer multiplies by 1/d where the reference divides: an input on a rounding
    # boundary may land on the other int8 (each such flip moves out by ~1e-4 of its scale)
    assert err < (1e-4 if device == "cpu" else 5e-3), err
    return err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"check: max error / max |out| = {check(device):.2e}", flush=True)
    if args.check_only:
        return
    from common import captured_us
    from quant_gemv_stack import LAYOUTS, random_planes

    from cvllm_cuda.kernels.gemv import gemv
    from cvllm_cuda.kernels.quant_gemv_int8 import quant_gemv_int8
    configs = [c for c in itertools.product((1, 2, 4, 8), (32, 64, 128, 256), (2, 4), (1, 3))
               if 2 <= c[0] * c[1] * 4 // (c[2] * 32) <= 64]
    results: dict = {}
    for shape, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        row = {}
        rows = [random_rowmajor(n, k, "cuda") for _ in range(args.layers)]
        nbytes = sum(t.numel() * t.element_size() for t in rows[0].values())
        for cfg in configs:
            if (k // 32) % cfg[1] or n % cfg[0]:
                continue
            try:
                row[str(cfg)] = captured_us(
                    lambda cfg=cfg, x=x, out=out, ws=rows: [row_gemv(x, w, out, cfg) for w in ws], args.layers)
            except Exception as exc:   # out of registers or shared memory
                print(f"  {shape} {cfg}: {type(exc).__name__}: {str(exc)[:60]}", flush=True)
        del rows
        kmajor = [random_planes(LAYOUTS["q4_k"], n, k) for _ in range(args.layers)]
        today = captured_us(lambda x=x, out=out, ws=kmajor: [quant_gemv_int8(x, w, out) for w in ws], args.layers)
        del kmajor
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)]
        bf16 = captured_us(lambda x=x, ws=dense: [gemv(x, w) for w in ws], args.layers)
        del dense
        torch.cuda.empty_cache()
        best = sorted(row.items(), key=lambda kv: kv[1])[:3]
        results[shape] = {"bytes": nbytes, "rowmajor_us": row, "kmajor_us": today, "bf16_gemv_us": bf16}
        print(f"{shape:8s} K-major {today:6.1f} us ({nbytes / today / 1e6:4.2f} TB/s), row-major best "
              + ", ".join(f"{key} {us:6.1f} us ({nbytes / us / 1e6:4.2f} TB/s)" for key, us in best)
              + f"; bf16 GEMV {bf16:6.1f} us ({n * k * 2 / bf16 / 1e6:4.2f} TB/s)", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
