"""Probe (issue 18): the decode-batch low-bit GEMM with the weight as wgmma's register operand.

Today's GEMM (quant_matmul._gemm_kernel, unpacked) computes out = x @ W^T with the unpacked weight tile as the second
``tl.dot`` operand, which Hopper's wgmma reads from shared memory: every K step stores the bf16 tile there (64 STS
a 64-element step, then a wgmma and a wait for it before the next unpack; q4_k (128, 8, 4, 4) at 64 rows compiled
for sm_90). Swapped, out^T = W @ x^T: the weight tile is the first operand, which wgmma takes from registers, so it
is unpacked straight into them, and x goes through shared memory instead, by asynchronous copies. That needs each
element position's slice of x contiguous: x position-major, x[t, S * K/P + w] = input w * P + S (P elements a word;
one permute a call, here a torch copy). Compiled for sm_90 on a CPU (2026-12-04): no STS, 8.6k instead of 9.9k loop
instructions per 1k elements of a 128-column tile (q4_k, 64 rows); the unpack's ~4.5 instructions an element stay.

The "packed" variants (4-bit planes without a high plane: Q4_0, Q4_1, Q4_K, GPTQ/AWQ 4-bit) unpack Marlin's way in
bf16: a lane of two weights 16 bits apart in the word, one lop3 into the mantissas of 128.0, an exact bf16x2
subtraction, one bf16x2 FMA with the factors rounded to bf16 (an error a little above the float path's: 1.0e-2 against
0.7e-2 of the largest output in the interpreter check), x in the lanes' order. Compiled: 5.5k loop instructions per 1k
elements (128 x 64 x 128-element steps, no spills), against today's kernel's 9.9k, still one small shared-memory
round trip (a layout conversion) a step. If the GEMM is bound by its unpacking (session 19: 0.8 TB/s at 2 rows), this
is where time comes from.

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


@triton.jit
def _pack2(lo, hi):
    """Two bf16 tensors -> int32 lanes holding lo in the low half, hi in the high one."""
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


_STEP = "lop3.b32 t, t, 0x000F000F, c, 0xEA; sub.rn.bf16x2 t, t, c; fma.rn.bf16x2 $%d, t, s2, o2; "
PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 c, s2, o2, t; .reg .b16 sb, ob; mov.b32 c, 0x43004300; cvt.rn.bf16.f32 sb, $5; "
    "cvt.rn.bf16.f32 ob, $6; mov.b32 s2, {sb, sb}; mov.b32 o2, {ob, ob}; mov.b32 t, $4; " + _STEP % 0
    + "shr.b32 t, $4, 4; " + _STEP % 1 + "shr.b32 t, $4, 8; " + _STEP % 2 + "shr.b32 t, $4, 12; " + _STEP % 3 + "}")


@triton.jit
def _pairs(word, scale, offset, ASM: tl.constexpr):
    """A 4-bit word's eight ``q * scale + offset`` in bf16, two a 32-bit lane: lane j holds elements j and j + 4
    (nibbles 16 bits apart: Marlin's trick in bf16, one lop3 puts both into the mantissas of 128.0, an exact bf16x2
    subtraction and one bf16x2 FMA with the factors rounded to bf16 give the two weights). Four int32 tensors."""
    if ASM:
        return tl.inline_asm_elementwise(PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [word, scale, offset],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        s = scale.to(tl.bfloat16).to(tl.float32)
        o = offset.to(tl.bfloat16).to(tl.float32)
        q0 = ((word >> 0) & 0xF).to(tl.float32) * s + o
        q1 = ((word >> 4) & 0xF).to(tl.float32) * s + o
        q2 = ((word >> 8) & 0xF).to(tl.float32) * s + o
        q3 = ((word >> 12) & 0xF).to(tl.float32) * s + o
        q4 = ((word >> 16) & 0xF).to(tl.float32) * s + o
        q5 = ((word >> 20) & 0xF).to(tl.float32) * s + o
        q6 = ((word >> 24) & 0xF).to(tl.float32) * s + o
        q7 = ((word >> 28) & 0xF).to(tl.float32) * s + o
        return (_pack2(q0.to(tl.bfloat16), q4.to(tl.bfloat16)), _pack2(q1.to(tl.bfloat16), q5.to(tl.bfloat16)),
                _pack2(q2.to(tl.bfloat16), q6.to(tl.bfloat16)), _pack2(q3.to(tl.bfloat16), q7.to(tl.bfloat16)))


@triton.jit
def _lanes_to_bf16(lanes, ASM: tl.constexpr):
    """int32 lanes [..., 2] (each lane twice along the last dimension) -> bf16 [..., 2]: element m the lane's half
    m (no instruction: the register is the pair)."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [lanes], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)
    else:
        half = tl.arange(0, 2)[None, None, None, None, :]
        return ((lanes >> (16 * half)) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit(do_not_specialize=["T"])
def _gemm_swapped_kernel(x_ptr, out_ptr, low_ptr, high_ptr, d_ptr, m_ptr, a_ptr, b_ptr, T, N, K, stride_xt,
                         stride_ot, LOW_BITS: tl.constexpr, HIGH_BITS: tl.constexpr, SCALE_GROUP: tl.constexpr,
                         SUPER_GROUP: tl.constexpr, A_MODE: tl.constexpr, B_MODE: tl.constexpr, B_CONST: tl.constexpr,
                         HAS_M: tl.constexpr, FLOAT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PACKED: tl.constexpr,
                         ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """out^T tile [BLOCK_N, BLOCK_M] += W tile [BLOCK_N, BLOCK_W words] @ x^T, one dot per element position S of
    the words; x position-major (above). PACKED (4-bit words without a high plane, bf16): one dot a K step over the
    words unpacked two weights a lane (_pairs), x in the lanes' order (x_lane_order)."""
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
        if PACKED:
            p0, p1, p2, p3 = _pairs(low, scale, offset, ASM)
            lanes = tl.join(tl.join(p0, p1), tl.join(p2, p3))             # [N, W, a, b]: lane 2 b + a
            wide = lanes[:, :, :, :, None] + tl.zeros((1, 1, 1, 1, 2), tl.int32)
            w = tl.reshape(_lanes_to_bf16(wide, ASM), (BLOCK_N, BLOCK_W * 8))
            ks = w0 * 8 + tl.arange(0, BLOCK_W * 8)
            x = tl.load(x_cols + ks[:, None], mask=(ks < K)[:, None] & t_ok[None, :], other=0.0)
            acc = dot_into(w, x, acc, IEEE, UPCAST)
        else:
            for S in tl.static_range(PER_WORD):
                x = tl.load(x_cols + (S * num_words + words)[:, None], mask=word_ok[:, None] & t_ok[None, :],
                            other=0.0)
                w = (quant_element(low, high, first, S, LOW_BITS, HIGH_BITS, FLOAT8) * scale + offset).to(x.dtype)
                acc = dot_into(w, x, acc, IEEE, UPCAST)
    out_ptrs = out_ptr + ts.to(tl.int64)[None, :] * stride_ot + cols[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_ok[:, None] & t_ok[None, :])


def packs(weight, x: torch.Tensor) -> bool:
    lay = weight.layout
    return lay.low_bits == 4 and not lay.high_bits and not lay.float8 and x.dtype == torch.bfloat16


def x_lane_order(x: torch.Tensor) -> torch.Tensor:
    """x with each word's 8 inputs in the packed tile's order: position a * 4 + b * 2 + m holds input 2 b + a + 4 m
    (lane j = 2 b + a of _pairs holds elements j and j + 4)."""
    t, k = x.shape
    return x.view(t, k // 8, 2, 2, 2).permute(0, 1, 4, 3, 2).contiguous().view(t, k)


def swapped_gemm(x: torch.Tensor, weight, out: torch.Tensor, config: tuple, packed: bool = False) -> None:
    """out = x @ W^T for x [T, K] (T rows of a decode batch), through the swapped kernel (``packed``: its packed
    unpack, where the layout allows it)."""
    from cvllm_cuda.kernels.pdl import options as pdl_options
    from cvllm_cuda.kernels.quant_tiles import kernel_tensors, upcast
    lay = weight.layout
    t, k = x.shape
    per_word = 32 // lay.low_bits
    packed = packed and packs(weight, x)
    x_pos = x_lane_order(x) if packed else x.view(t, k // per_word, per_word).transpose(1, 2).contiguous().view(t, k)
    block_n, block_w, warps, stages = config
    block_m = 16 if t <= 16 else 64 if t <= 64 else 128
    grid = (triton.cdiv(weight.out_features, block_n), triton.cdiv(t, block_m))
    _gemm_swapped_kernel[grid](x_pos, out, *kernel_tensors(weight), t, weight.out_features, k, x_pos.stride(0),
                               out.stride(0), **lay.kernel_args(), BLOCK_M=block_m, BLOCK_N=block_n,
                               BLOCK_W=max(1, block_w * lay.low_bits // 4), IEEE=x.dtype == torch.float32,
                               UPCAST=upcast(x.dtype), PACKED=packed, ASM=not triton.knobs.runtime.interpret,
                               num_warps=warps, num_stages=stages, **pdl_options(x.device))


def check(names: list[str]) -> dict:
    """Each layout's relative max error against float32 on a small weight, at a few row counts."""
    from test_quant_matmul import LAYOUTS, random_weight

    from cvllm_cuda.quant_planes import dequantize_planes
    errors = {}
    n0, k0 = (1024, 4096) if DEV == "cuda" else (128, 512)
    for name in names:
        weight = random_weight(LAYOUTS[name], n0, k0, DEV, seed=1)
        ref_w = dequantize_planes(weight).T.float()
        for packed in (False, True) if packs(weight, torch.empty(0, dtype=torch.bfloat16)) else (False,):
            worst = 0.0
            for t in (2, 16, 40) if DEV == "cpu" else (2, 16, 64, 128):
                x = torch.randn(t, k0, device=DEV, dtype=torch.bfloat16)
                out = torch.empty(t, n0, device=DEV, dtype=torch.bfloat16)
                swapped_gemm(x, weight, out, CONFIGS[0] if DEV == "cuda" else (64, 8, 4, 1), packed)
                ref = x.float() @ ref_w
                worst = max(worst, ((out.float() - ref).abs().max() / ref.abs().max()).item())
            label = name + (" packed" if packed else "")
            errors[label] = worst
            print(f"{label}: max error {worst:.2e} of the largest output", flush=True)
            assert worst < 2e-2, (label, worst)
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
                for packed in (False, True) if packs(layers[0]["o"], xs[4096]) else (False,):
                    try:
                        row[f"{config}{' packed' if packed else ''}"] = captured_us(
                            stack(lambda x, w, o, c=config, p=packed: swapped_gemm(x, w, o, c, p)), per=2)
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
