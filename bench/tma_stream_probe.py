"""Probe (issue 18): how fast can the batch-1 GEMV's programs stream a low-bit plane, by pointer loads (cp.async,
what the int8 GEMV does today) and by the tensor memory accelerator (TMA, CVLLM_GEMV_TMA)?

On the H200 the int8 GEMV reads a Llama-3-8B layer's Q4_K planes at 1.7-3.0 TB/s against a 4.1 TB/s copy rate; a
load-only kernel of its tiling reached ~2.5 (docs/benchmarks.md), so the loads themselves are the limit, not the
dp4a arithmetic. At one program an SM (the default K split) each SM needs ~31 GB/s, about 31 KB in flight at a
microsecond of latency; a 3-stage cp.async pipeline of 8 KB tiles keeps ~16. TMA copies a whole tile with one
instruction, so deeper pipelines cost no registers and no per-thread address arithmetic.

This kernel does only the loads: each program XORs its column tile's words over its K range and stores the result
(the loads cannot be dropped), over the Q4_K planes of a stack of Llama-3-8B layers (each layer its own planes: no
L2 reuse) captured in one CUDA graph, for tiles, stages, K splits and both load paths. Printed: microseconds a
layer and TB/s, beside a torch copy of the same bytes.

    python bench/tma_stream_probe.py --json $OUT/tma_stream_probe.json        # on the H200 (~1 min)
    TRITON_INTERPRET=1 python bench/tma_stream_probe.py --check-only          # the kernel's sums, on a CPU
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LOW_BITS = 4
# (BLOCK_N, BLOCK_W, warps, stages): the int8 GEMV's Q4_K default (32, 64, 4, 3) first, then deeper and wider ones
CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 5), (32, 64, 4, 8), (32, 128, 4, 4), (32, 128, 8, 4), (64, 64, 4, 4),
           (16, 128, 4, 6)]


@triton.jit
def _stream_kernel(low_ptr, low_desc, out_ptr, N, WORDS, SPLIT_WORDS, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
                   STAGES: tl.constexpr, TMA: tl.constexpr):
    col0 = tl.program_id(0) * BLOCK_N
    start = tl.program_id(1) * SPLIT_WORDS
    end = tl.minimum(WORDS, start + SPLIT_WORDS)
    cols = col0 + tl.arange(0, BLOCK_N)
    ptrs = low_ptr + (start + tl.arange(0, BLOCK_W))[:, None] * N + cols[None, :]
    acc = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.int32)
    for w0 in tl.range(start, end, BLOCK_W, num_stages=STAGES):
        if TMA:
            acc ^= low_desc.load([w0, col0])
        else:   # whole tiles only (the probe's shapes divide), so no masks
            acc ^= tl.load(ptrs)
            ptrs += BLOCK_W * N
    tl.store(out_ptr + tl.program_id(1) * N + cols, tl.xor_sum(acc, 0))


def stream(low: torch.Tensor, out: torch.Tensor, config: tuple, splits: int, tma: bool,
           descriptor: TensorDescriptor | None = None) -> None:
    """out [splits, N] = the XOR of each split's words of ``low`` [words, N], column by column."""
    words, n = low.shape
    block_n, block_w, warps, stages = config
    split_words = triton.cdiv(triton.cdiv(words, splits), block_w) * block_w
    if tma and descriptor is None:
        descriptor = TensorDescriptor.from_tensor(low, [block_w, block_n])
    _stream_kernel[(triton.cdiv(n, block_n), triton.cdiv(words, split_words))](
        low, descriptor, out, n, words, split_words, BLOCK_N=block_n, BLOCK_W=block_w, STAGES=stages, TMA=tma,
        num_warps=warps)


def check() -> None:
    """Both load paths give each split's XOR of the words (Triton's interpreter reads descriptors too)."""
    low = torch.randint(-(1 << 31), 1 << 31, (256, 96), dtype=torch.int32)
    for splits in (1, 2):
        want = low.view(splits, -1, 96)
        want = torch.stack([torch.from_numpy(__import__("numpy").bitwise_xor.reduce(w.numpy(), axis=0))
                            for w in want])
        for tma in (False, True):
            out = torch.zeros(splits, 96, dtype=torch.int32)
            stream(low, out, (32, 64, 4, 3), splits, tma)
            assert torch.equal(out, want), (splits, tma)
    print("the probe's kernel: both load paths give the XOR of every split's words")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pps", default="1,2", help="programs per SM the K split aims at (as the GEMV's split_k)")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    check()
    if args.check_only:
        return
    from common import captured_us

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    planes = [{s: torch.randint(-(1 << 31), 1 << 31, (k * LOW_BITS // 32, n), dtype=torch.int32, device="cuda")
               for s, (n, k) in SHAPES.items()} for _ in range(args.layers)]
    results: dict = {"gpu": torch.cuda.get_device_name(), "sms": sms, "shapes": {}}
    for s, (n, _) in SHAPES.items():
        layer_planes = [layer[s] for layer in planes]
        nbytes = layer_planes[0].numel() * 4

        copies = [torch.empty_like(p) for p in layer_planes]

        def copy(sources=layer_planes, targets=copies):
            for target, source in zip(targets, sources):
                target.copy_(source)

        copy_us = captured_us(copy, args.layers)
        del copy, copies
        # a copy reads and writes its bytes: TB/s of its traffic is twice its read rate
        row = {"bytes": nbytes, "copy_us": copy_us, "copy_read_tb_s": nbytes / copy_us / 1e6, "runs": {}}
        print(f"{s:8s} {nbytes / 1e6:6.1f} MB a layer; torch copy {copy_us:6.1f} us ({2 * nbytes / copy_us / 1e6:.2f} "
              f"TB/s read + written)", flush=True)
        for config in CONFIGS:
            block_n, block_w = config[:2]
            tiles = triton.cdiv(n, block_n)
            steps = triton.cdiv(layer_planes[0].shape[0], block_w)
            for pps in (int(p) for p in args.pps.split(",")):
                splits = max(1, min(triton.cdiv(pps * sms, tiles), steps // 4, 16))
                outs = [torch.empty(splits, n, dtype=torch.int32, device="cuda") for _ in layer_planes]
                for tma in (False, True):
                    descriptors = [TensorDescriptor.from_tensor(p, [block_w, block_n]) if tma else None
                                   for p in layer_planes]

                    def run(planes=layer_planes, outs=outs, descriptors=descriptors, config=config, splits=splits,
                            tma=tma):
                        for p, o, d in zip(planes, outs, descriptors):
                            stream(p, o, config, splits, tma, d)

                    try:
                        us = captured_us(run, args.layers)
                    except Exception as exc:   # a tile that does not fit: say so and go on
                        print(f"  {config} pps {pps} {'tma' if tma else 'ptr'}: failed ({type(exc).__name__}: "
                              f"{str(exc)[:120]})", flush=True)
                        continue
                    key = f"{','.join(map(str, config))} pps {pps} {'tma' if tma else 'ptr'}"
                    row["runs"][key] = {"us": us, "tb_s": nbytes / us / 1e6, "splits": splits}
                    print(f"  {key:28s} splits {splits:2d}: {us:6.2f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)
        results["shapes"][s] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
