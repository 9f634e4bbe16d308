"""Probe (issue 18): how fast can the batch-1 GEMV's programs stream a low-bit plane, by pointer loads (cp.async,
what the int8 GEMV does today) and by the tensor memory accelerator (TMA, CVLLM_GEMV_TMA)?

On the H200 the int8 GEMV reads a Llama-3-8B layer's Q4_K planes at 1.7-3.0 TB/s against a 4.1 TB/s copy rate; a
load-only kernel of its tiling reached ~2.5 (docs/benchmarks.md), so the loads themselves are the limit, not the
dp4a arithmetic. At one program an SM (the default K split) each SM needs ~31 GB/s, about 31 KB in flight at a
microsecond of latency; a 3-stage cp.async pipeline of 8 KB tiles keeps ~16. TMA copies a whole tile with one
instruction, so deeper pipelines cost no registers and no per-thread address arithmetic.

This kernel does only the loads: each program XORs its column tile's words over its K range and stores the result
(the loads cannot be dropped), over the Q4_K planes of a stack of Llama-3-8B layers (each layer its own planes: no
L2 reuse) captured in one CUDA graph, for tiles, stages, K splits and both load paths; then the same with the small
loads the GEMV's step makes beside the words (factor planes of 2 and 1 bytes, x's int8 packs, scales and sums:
many more requests a step than the words' 16-byte copies), which tells whether requests rather than bytes are the
limit. Printed: microseconds a layer and TB/s, beside a torch copy of the words.

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
CONFIGS = [(32, 64, 4, 3), (32, 64, 4, 6), (32, 128, 8, 4), (16, 128, 4, 6)]


@triton.jit
def _stream_kernel(low_ptr, d_ptr, m_ptr, a_ptr, b_ptr, packs_ptr, xd_ptr, xsum_ptr, low_desc, d_desc, m_desc, a_desc,
                   b_desc, packs_desc, xd_desc, xsum_desc, out_ptr, sums_ptr, N, WORDS, SPLIT_WORDS,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
                   SMALL: tl.constexpr):
    """Each program: the XOR of its column tile's words over its K range into ``out`` [splits, N]; with SMALL also
    the loads the int8 GEMV's Q4_K step makes beside them (its factor planes d, m [K / 256, N] f16 and a, b [K / 32,
    N] u8, x's int8 packs [K / 4] i32 and block scales and sums [K / 32] f32), summed into ``sums`` [splits, N].
    TMA: every one of those through its descriptor; else by pointer (the pipeline's cp.async copies)."""
    col0 = tl.program_id(0) * BLOCK_N
    start = tl.program_id(1) * SPLIT_WORDS
    end = tl.minimum(WORDS, start + SPLIT_WORDS)
    cols = col0 + tl.arange(0, BLOCK_N)
    SUPER: tl.constexpr = BLOCK_W * 8 // 256     # factor rows a step: super-groups, scale groups, x blocks
    GROUPS: tl.constexpr = BLOCK_W // 4
    acc = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.int32)
    fsum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    psum = tl.zeros((BLOCK_W * 2,), dtype=tl.int32)
    xsums = tl.zeros((GROUPS,), dtype=tl.float32)
    for w0 in tl.range(start, end, BLOCK_W, num_stages=STAGES):
        if TMA:
            acc ^= low_desc.load([w0, col0])
        else:   # whole tiles only (the probe's shapes divide), so no masks
            acc ^= tl.load(low_ptr + (w0 + tl.arange(0, BLOCK_W))[:, None] * N + cols[None, :])
        if SMALL:
            if TMA:
                d = d_desc.load([w0 // 32, col0])
                m = m_desc.load([w0 // 32, col0])
                a = a_desc.load([w0 // 4, col0])
                b = b_desc.load([w0 // 4, col0])
                packs = packs_desc.load([w0 * 2])
                xd = xd_desc.load([w0 // 4])
                xsum = xsum_desc.load([w0 // 4])
            else:
                srow = (w0 // 32 + tl.arange(0, SUPER))[:, None] * N + cols[None, :]
                grow = (w0 // 4 + tl.arange(0, GROUPS))[:, None] * N + cols[None, :]
                d = tl.load(d_ptr + srow)
                m = tl.load(m_ptr + srow)
                a = tl.load(a_ptr + grow)
                b = tl.load(b_ptr + grow)
                packs = tl.load(packs_ptr + w0 * 2 + tl.arange(0, BLOCK_W * 2))
                xd = tl.load(xd_ptr + w0 // 4 + tl.arange(0, GROUPS))
                xsum = tl.load(xsum_ptr + w0 // 4 + tl.arange(0, GROUPS))
            fsum += tl.sum(d.to(tl.float32) + m.to(tl.float32), 0) + tl.sum(a.to(tl.float32) + b.to(tl.float32), 0)
            psum ^= packs
            xsums += xd + xsum
    tl.store(out_ptr + tl.program_id(1) * N + cols, tl.xor_sum(acc, 0))
    if SMALL:
        tl.store(sums_ptr + tl.program_id(1) * N + cols, fsum + tl.sum(xsums, 0) + tl.xor_sum(psum, 0).to(tl.float32))


# where check() runs the kernel: Triton's interpreter reads CPU tensors, a compiled kernel the GPU's (the H200 at
# 7f7442b: "cannot be accessed from Triton (cpu tensor?)")
DEVICE = "cpu" if triton.knobs.runtime.interpret or not torch.cuda.is_available() else "cuda"


class Planes:
    """A Q4_K weight's planes and factors as the int8 GEMV reads them (random), and x's int8 form."""

    def __init__(self, n: int, k: int, device: str = "cuda"):
        def ints(*shape):
            return torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int32, device=device)

        self.low = ints(k * LOW_BITS // 32, n)
        self.d, self.m = (torch.rand(k // 256, n, device=device) * 1e-3).half(), (torch.rand(k // 256, n,
                                                                                            device=device)).half()
        self.a = torch.randint(0, 64, (k // 32, n), dtype=torch.uint8, device=device)
        self.b = torch.randint(0, 64, (k // 32, n), dtype=torch.uint8, device=device)
        self.packs = ints(k // 4)
        self.xd, self.xsum = torch.rand(k // 32, device=device), torch.rand(k // 32, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.low, self.d, self.m, self.a, self.b, self.packs, self.xd, self.xsum

    def nbytes(self, small: bool) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensors() if small else (self.low,)))

    def descriptors(self, block_n: int, block_w: int) -> tuple[TensorDescriptor, ...]:
        boxes = ([block_w, block_n], [block_w * 8 // 256, block_n], [block_w * 8 // 256, block_n],
                 [block_w // 4, block_n], [block_w // 4, block_n], [block_w * 2], [block_w // 4], [block_w // 4])
        return tuple(TensorDescriptor.from_tensor(t, box) for t, box in zip(self.tensors(), boxes))


def stream(planes: Planes, out: torch.Tensor, sums: torch.Tensor, config: tuple, splits: int, tma: bool,
           small: bool, descriptors: tuple | None = None) -> None:
    """out [splits, N] = the XOR of each split's words, column by column; with ``small`` also ``sums`` (the kernel's
    SMALL)."""
    words, n = planes.low.shape
    block_n, block_w, warps, stages = config
    split_words = triton.cdiv(triton.cdiv(words, splits), block_w) * block_w
    if tma and descriptors is None:
        descriptors = planes.descriptors(block_n, block_w)
    _stream_kernel[(triton.cdiv(n, block_n), triton.cdiv(words, split_words))](
        *planes.tensors(), *(descriptors or (None,) * 8), out, sums, n, words, split_words, BLOCK_N=block_n,
        BLOCK_W=block_w, STAGES=stages, TMA=tma, SMALL=small, num_warps=warps)


def check() -> None:
    """Both load paths give each split's XOR of the words and sums of the small loads (Triton's interpreter reads
    descriptors too)."""
    import numpy as np
    planes = Planes(96, 2048, "cpu")
    for splits in (1, 2):
        per = planes.low.shape[0] // splits
        want = torch.stack([torch.from_numpy(np.bitwise_xor.reduce(planes.low[j * per:(j + 1) * per].numpy(), 0))
                            for j in range(splits)])
        small = []
        for j in range(splits):   # a split of `per` words covers per * 8 inputs
            ks = slice(j * per * 8 // 256, (j + 1) * per * 8 // 256), slice(j * per // 4, (j + 1) * per // 4)
            f = (planes.d[ks[0]].float() + planes.m[ks[0]].float()).sum(0) + \
                (planes.a[ks[1]].float() + planes.b[ks[1]].float()).sum(0)
            x = (planes.xd[ks[1]] + planes.xsum[ks[1]]).sum()
            p = np.bitwise_xor.reduce(planes.packs[j * per * 2:(j + 1) * per * 2].numpy())
            small.append(f + x + float(p))
        for tma in (False, True):
            out, sums = torch.zeros(splits, 96, dtype=torch.int32), torch.zeros(splits, 96)
            on_device = Planes.__new__(Planes)   # the same planes where the kernel runs (the GPU, unless interpreted)
            on_device.__dict__.update({name: t.to(DEVICE) for name, t in vars(planes).items()})
            out, sums = out.to(DEVICE), sums.to(DEVICE)
            stream(on_device, out, sums, (32, 64, 4, 3), splits, tma, small=True)
            assert torch.equal(out.cpu(), want), (splits, tma)
            torch.testing.assert_close(sums.cpu(), torch.stack(small), rtol=1e-5, atol=1e-2)
    print("the probe's kernel: both load paths give the words' XOR and the small loads' sums of every split")


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
    results: dict = {"gpu": torch.cuda.get_device_name(), "sms": sms, "shapes": {}}
    for s, (n, k) in SHAPES.items():
        layers = [Planes(n, k) for _ in range(args.layers)]
        words_bytes, all_bytes = layers[0].nbytes(False), layers[0].nbytes(True)
        copies = [torch.empty_like(p.low) for p in layers]

        def copy(sources=layers, targets=copies):
            for target, source in zip(targets, sources):
                target.copy_(source.low)

        copy_us = captured_us(copy, args.layers)
        del copy, copies
        row = {"words_bytes": words_bytes, "all_bytes": all_bytes, "copy_us": copy_us, "runs": {}}
        print(f"{s:8s} {words_bytes / 1e6:6.1f} MB of words a layer ({all_bytes / 1e6:.1f} with factors and x); "
              f"torch copy of the words {copy_us:6.1f} us ({2 * words_bytes / copy_us / 1e6:.2f} TB/s read + "
              f"written)", flush=True)
        for config in CONFIGS:
            block_n, block_w = config[:2]
            tiles = triton.cdiv(n, block_n)
            steps = triton.cdiv(layers[0].low.shape[0], block_w)
            for pps in (int(p) for p in args.pps.split(",")):
                splits = max(1, min(triton.cdiv(pps * sms, tiles), steps // 4, 16))
                outs = [(torch.empty(splits, n, dtype=torch.int32, device="cuda"),
                         torch.empty(splits, n, device="cuda")) for _ in layers]
                for small in (False, True):
                    for tma in (False, True):
                        descriptors = [p.descriptors(block_n, block_w) if tma else None for p in layers]

                        def run(layers=layers, outs=outs, descriptors=descriptors, config=config, splits=splits,
                                tma=tma, small=small):
                            for p, (o, sums), d in zip(layers, outs, descriptors):
                                stream(p, o, sums, config, splits, tma, small, d)

                        name = (f"{','.join(map(str, config))} pps {pps} {'all' if small else 'words'} "
                                f"{'tma' if tma else 'ptr'}")
                        try:
                            us = captured_us(run, args.layers)
                        except Exception as exc:   # a tile that does not fit: say so and go on
                            print(f"  {name}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
                            continue
                        nbytes = all_bytes if small else words_bytes
                        row["runs"][name] = {"us": us, "tb_s": nbytes / us / 1e6, "splits": splits}
                        print(f"  {name:34s} splits {splits:2d}: {us:6.2f} us {nbytes / us / 1e6:5.2f} TB/s",
                              flush=True)
        results["shapes"][s] = row
        del layers
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
