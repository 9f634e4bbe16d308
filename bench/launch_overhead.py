"""Host cost of launching each CUDA-backend kernel (what an eager step pays per op, since eager steps
enqueue ~10 kernels a layer): microseconds of host time per call, no synchronisation inside the loop,
for Llama-3-8B-shaped inputs of one decode token and of an 8192-token prefill; torch ops of the same
inputs beside them. Then where the time of the slowest launch goes (cProfile).

    python bench/launch_overhead.py          # on the GPU machine
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from cvllm_cuda.kernels.activation import silu_and_mul
from cvllm_cuda.kernels.kv_cache import write_kv
from cvllm_cuda.kernels.paged_attention import paged_attention
from cvllm_cuda.kernels.rms_norm import fused_add_rms_norm
from cvllm_cuda.kernels.rotary import rotary


def per_call_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - started) / calls
    torch.cuda.synchronize()
    return host * 1e6


def cases(tokens: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    hidden, heads, kv_heads, d, inter, block = 4096, 32, 8, 128, 14336, 16
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device=dev, dtype=dt)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=dev, dtype=dt)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    positions = torch.arange(tokens, device=dev)
    cos_sin = torch.randn(8192, d, device=dev, dtype=dt)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
    num_blocks = tokens // block + 64
    k_cache = torch.randn(num_blocks, block, kv_heads, d, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    slots = torch.arange(tokens, device=dev)
    seqs = max(1, tokens // 1024)
    qlen = tokens // seqs
    qsl = torch.arange(seqs + 1, device=dev, dtype=torch.int32) * qlen
    seq_lens = torch.full((seqs,), qlen if tokens > 1 else 1024, device=dev, dtype=torch.int32)
    tables = torch.arange(seqs * 64, device=dev, dtype=torch.int32).view(seqs, 64) % num_blocks
    q3, k3, v3 = (t.reshape(tokens, -1, d) for t in (q, k, v))
    w_o = torch.randn(hidden, hidden, device=dev, dtype=dt)
    return {
        "rms_norm + residual": lambda: fused_add_rms_norm(x, res, w, 1e-5),
        "rotary q+k": lambda: rotary(positions, q, k, cos_sin, d),
        "write_kv": lambda: write_kv(k3, v3, k_cache, v_cache, slots),
        "paged_attention": lambda: paged_attention(q3, k_cache, v_cache, qsl, seq_lens, tables, qlen,
                                                   d ** -0.5, None, None),
        "silu_and_mul": lambda: silu_and_mul(gate_up),
        "torch: x + res": lambda: x + res,
        "torch: x @ w (4096x4096)": lambda: x @ w_o,
    }


def main() -> None:
    print(f"{'op':28s} {'1 token':>10s} {'8192 tokens':>12s}   (host µs per call)")
    small, large = cases(1), cases(8192)
    for name in small:
        print(f"{name:28s} {per_call_us(small[name]):10.1f} {per_call_us(large[name], 100):12.1f}")
    slowest = max(small, key=lambda n: per_call_us(small[n], 100) if not n.startswith("torch") else 0)
    profiler = cProfile.Profile()
    fn = small[slowest]
    profiler.enable()
    for _ in range(200):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"\nwhere 200 launches of {slowest} spend host time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
