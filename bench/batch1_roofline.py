"""What issue 18's batch-1 targets ask of the low-bit GEMVs, from the bytes a decode step must read (no GPU needed).

A batch-1 decode step of the Llama-3-8B shape reads every layer's weights once, the LM head (bf16 for ``--isq``,
as candle-vllm keeps it) and a little KV cache; the rest of its time (norms, RoPE, attention's launches, the
sampler) does not shrink with the weights. Taking bf16's measured step and the H200's measured read ceiling, this
prints for each plane layout (as the GPU holds it: planes and factors) the fastest step possible if its GEMVs
streamed at the ceiling, the best ratio to bf16 that allows, and the bandwidth its GEMVs (activation quantizer
included) must reach for the issue's target ratio.

    python bench/batch1_roofline.py                          # the H200 figures of docs/benchmarks.md
    python bench/batch1_roofline.py --bf16-step-ms 4.10 --read-tbs 4.25 --measured q4_k=1.65,q8_0=1.33

``--measured``: ratios to bf16 measured in one run each; the last column is what such a step implies for its GEMVs
(the head and the rest taken as above).
"""

from __future__ import annotations

import argparse

from quant_gemv_stack import LAYOUTS, SHAPES, random_planes

LAYERS = 32
VOCAB, HIDDEN = 128256, 4096
# issue 18's batch-1 targets (ratio of bf16's step time); FP8 weights: one byte and a float32 scale per output row
TARGETS = {"q4_k": 2.0, "gptq4_g128": 2.2, "q8_0": 1.6, "fp8": 1.6}


def layer_bytes(name: str) -> float:
    """A layer's four projections in ``name``'s planes and factors, as the GPU holds them (their tensors' sizes on
    the meta device); FP8 weights a byte each and a float32 scale a row."""
    if name == "fp8":
        return sum(n * k + 4 * n for n, k in SHAPES.values())
    return sum(random_planes(LAYOUTS[name], n, k, "meta").nbytes() for n, k in SHAPES.values())


def layer_bytes_bf16() -> float:
    return sum(n * k for n, k in SHAPES.values()) * 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16-step-ms", type=float, default=4.10, help="bf16's batch-1 GPU step (session 23: 4.10)")
    ap.add_argument("--read-tbs", type=float, default=4.25, help="the read ceiling (bench/ceilings.py: 4.25 TB/s)")
    ap.add_argument("--measured", default="q4_k=1.65,gptq4_g128=1.38,q8_0=1.33,fp8=1.43",
                    help="measured batch-1 ratios to bf16 (docs/benchmarks.md, sessions 13-23)")
    args = ap.parse_args()
    bw = args.read_tbs * 1e9                      # bytes a millisecond
    head = VOCAB * HIDDEN * 2
    bf16_weights = LAYERS * layer_bytes_bf16() + head
    rest = args.bf16_step_ms - bf16_weights / bw  # what bf16's step spends beyond reading its weights at the ceiling
    measured = dict(kv.split("=") for kv in args.measured.split(",") if kv)
    print(f"bf16: {bf16_weights / 1e9:.2f} GB a step, {bf16_weights / bw:.3f} ms at {args.read_tbs} TB/s; the rest "
          f"of its {args.bf16_step_ms} ms step: {rest:.3f} ms ({rest / LAYERS * 1e3:.1f} us a layer)")
    print(f"{'layout':11s} {'bits':>5s} {'MB/layer':>8s} {'best ms':>7s} {'best x':>6s} {'target':>6s} "
          f"{'GEMVs need':>10s} {'measured':>8s} {'so GEMVs at':>11s}")
    for name, target in TARGETS.items():
        per_layer = layer_bytes(name)
        best = LAYERS * per_layer / bw + head / bw + rest
        need_ms = args.bf16_step_ms / target - head / bw - rest          # the four GEMVs of every layer together
        need = f"{LAYERS * per_layer / need_ms / 1e9:.2f} TB/s" if need_ms > 0 else "impossible"
        got = implied = ""
        if name in measured:
            ratio = float(measured[name])
            got = f"{ratio:.2f}x"
            implied = f"{LAYERS * per_layer / (args.bf16_step_ms / ratio - head / bw - rest) / 1e9:.2f} TB/s"
        bits = per_layer * 8 / sum(n * k for n, k in SHAPES.values())
        print(f"{name:11s} {bits:5.2f} {per_layer / 1e6:8.1f} {best:7.3f} {args.bf16_step_ms / best:6.2f} "
              f"{target:6.1f} {need:>10s} {got:>8s} {implied:>11s}")


if __name__ == "__main__":
    main()
