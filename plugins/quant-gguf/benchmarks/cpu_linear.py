"""Per-call latency of the CPU compute forms for Q4_1 weights on SmolLM2-135M shapes.

    python plugins/quant-gguf/benchmarks/cpu_linear.py [--threads 2] [--budget 0.15]

Compares torch's int4-packed matmul (bf16 activations), the weight dequantized once (bf16, fp32)
and dequantizing on every call. Each timed call uses the next of enough weight copies to exceed
the last-level cache, as a model's 30 layers do, so the weights stream from memory. The last rows
run all 30 decoder layers' linears of SmolLM2-135M (qkv, o, gate_up, down) once: one decode step
without the LM head; then one weight at growing token counts (prefill).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import torch.nn.functional as F

from cvllm_gguf.dequant import dequantize
from cvllm_gguf.int4pack import int4pack_linear, pack_q4_for_int4mm
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.quantize import quantize

QTYPE = GGMLType.Q4_1
SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 192), (576, 49152)]  # (in, out)
LAYER = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate_up, down
COLD_BYTES = 96 << 20  # three times a 32 MiB L3


def per_call_ms(fn, budget: float) -> float:
    fn()  # warm-up
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < budget:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e3


def nbytes(form) -> int:
    return sum(t.numel() * t.element_size() for t in (form if isinstance(form, tuple) else (form,)))


def forms(in_f: int, out_f: int) -> dict[str, object]:
    raw = quantize(torch.randn(out_f, in_f) * 0.05, QTYPE)
    w32 = dequantize(raw, QTYPE, (out_f, in_f))
    return {"int4": pack_q4_for_int4mm(raw, QTYPE, in_f), "bf16": w32.to(torch.bfloat16), "fp32": w32, "raw": raw}


def matmuls(x: torch.Tensor) -> dict[str, object]:
    xb = x.to(torch.bfloat16)
    return {
        "int4": lambda form: int4pack_linear(xb, *form),
        "bf16": lambda form: F.linear(xb, form),
        "fp32": lambda form: F.linear(x, form),
        "raw": lambda form: F.linear(x, dequantize(form, QTYPE, (form.shape[0], x.shape[-1]))),
    }


def shape_table(budget: float) -> None:
    print("| in→out | batch | int4pack bf16 | dequantized bf16 | dequantized fp32 | dequant per call (fp32) |")
    print("|---|---|---|---|---|---|")
    for in_f, out_f in SHAPES:
        copies = [forms(in_f, out_f)]
        copies += [forms(in_f, out_f) for _ in range(math.ceil(COLD_BYTES / nbytes(copies[0]["int4"])) - 1)]
        for batch in (1, 16):
            row = []
            for kind, matmul in matmuls(torch.randn(batch, in_f)).items():
                pool = itertools.cycle([c[kind] for c in copies])
                row.append(per_call_ms(lambda matmul=matmul, pool=pool: matmul(next(pool)), budget))
            print(f"| {in_f}→{out_f} | {batch} | " + " | ".join(f"{t:.3f}" for t in row) + " |", flush=True)


def model_rows(budget: float) -> None:
    layers = [[forms(i, o) for i, o in LAYER] for _ in range(30)]
    print("| 30 layers (one decode step, no LM head) | batch | int4pack bf16 | dequantized bf16 | "
          "dequantized fp32 | dequant per call (fp32) |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 16):
        inputs = {i: torch.randn(batch, i) for i, _ in LAYER}
        row = []
        for kind in ("int4", "bf16", "fp32", "raw"):
            calls = [(matmuls(inputs[i])[kind], layer[n][kind]) for layer in layers for n, (i, _) in enumerate(LAYER)]
            row.append(per_call_ms(lambda calls=calls: [fn(form) for fn, form in calls], budget))
        print(f"| SmolLM2-135M | {batch} | " + " | ".join(f"{t:.2f}" for t in row) + " |", flush=True)


def prefill_rows(budget: float) -> None:
    """How the two bf16 forms scale with the number of tokens in one call (gate_up, 576→3072)."""
    form = forms(576, 3072)
    print("| tokens per call (576→3072) | int4pack bf16 | dequantized bf16 |")
    print("|---|---|---|")
    for tokens in (1, 4, 16, 64, 256, 512):
        run = matmuls(torch.randn(tokens, 576))
        row = [per_call_ms(lambda fn=run[kind], w=form[kind]: fn(w), budget) for kind in ("int4", "bf16")]
        print(f"| {tokens} | " + " | ".join(f"{t:.3f}" for t in row) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget", type=float, default=0.15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{QTYPE.name} weights, torch {torch.__version__}, {args.threads} threads; milliseconds per call")
    with torch.no_grad():
        shape_table(args.budget)
        model_rows(args.budget)
        prefill_rows(args.budget)


if __name__ == "__main__":
    main()
