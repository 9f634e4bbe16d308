"""The grouped-GEMM MoE over stacked low-bit experts (kernels/fused_moe_planes.py) against each expert dequantized
(quant_planes.dequantize_planes) and the pairs summed in float32: a 4-bit K-quant layout, gate and up in two
layouts (Q4_K_M-style mixes), decode- and prefill-sized batches, another rank's experts. Triton's interpreter
without a GPU (float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cvllm_cuda.kernels.fused_moe_planes import fused_moe_planes, stack_experts
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight, dequantize_planes, pack_plane

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
Q4_K = QuantLayout(4, 0, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True)
Q8_0 = QuantLayout(8, 0, 32, 32, b_const=-128)
Q6_K = QuantLayout(4, 2, 16, 256, a_mode=1, b_mode=1, b_const=-32)


def random_planes(layout: QuantLayout, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    q = torch.randint(0, 1 << layout.bits(), (n, k), generator=gen)
    supers, scales = k // layout.super_group, k // layout.scale_group
    half = lambda: (torch.rand(supers, n, generator=gen) * 2e-2 + 1e-3).half()   # noqa: E731
    a = b = None
    if layout.a_mode == 1:
        a = torch.randint(-32, 32, (scales, n), generator=gen).to(torch.int8)
    elif layout.a_mode == 2:
        a = torch.randint(0, 64, (scales, n), generator=gen).to(torch.uint8)
    if layout.b_mode == 2:
        b = torch.randint(0, 64, (scales, n), generator=gen).to(torch.uint8)
    return QuantWeight(layout, n, k, low=pack_plane(q & ((1 << layout.low_bits) - 1), layout.low_bits),
                       high=pack_plane(q >> layout.low_bits, layout.high_bits) if layout.high_bits else None,
                       d=half(), m=half() if layout.has_m else None, a=a, b=b)


def silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("tokens, foreign", [(1, False), (3, True), (30, False)])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("unpacked", [True, False], ids=["unpacked", "per-position"])
def test_low_bit_experts_match_their_dequantized_sum(tokens, foreign, split, unpacked, monkeypatch):
    """(The per-position kernel is the fallback for a tile that does not compile: forced here by a failing
    unpacked launch.)"""
    if not unpacked:
        from cvllm_cuda.kernels import fused_moe_planes as fmp
        from cvllm_cuda.kernels import quant_tiles
        real = fmp._launch

        def launch(*args, unpacked):
            if unpacked:
                raise RuntimeError("out of resource: shared memory (raised by the test)")
            real(*args, unpacked=False)

        monkeypatch.setattr(fmp, "_launch", launch)
        monkeypatch.setattr(quant_tiles, "DOES_NOT_FIT", set())
        monkeypatch.setattr(quant_tiles, "COMPILED", set())
    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden_size, inter = 4, 2, 256, 256
    if split:   # gate Q4_K, up Q8_0 (per-part layouts), down Q6_K
        gate = [random_planes(Q4_K, inter, hidden_size, gen) for _ in range(experts)]
        up = [random_planes(Q8_0, inter, hidden_size, gen) for _ in range(experts)]
        parts = [stack_experts(gate), stack_experts(up)]
        w13 = [torch.cat([dequantize_planes(g), dequantize_planes(u)]) for g, u in zip(gate, up)]
    else:
        both = [random_planes(Q4_K, 2 * inter, hidden_size, gen) for _ in range(experts)]
        parts, w13 = [stack_experts(both)], [dequantize_planes(w) for w in both]
    downs = [random_planes(Q6_K, hidden_size, inter, gen) for _ in range(experts)]
    w2 = [dequantize_planes(w) for w in downs]
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    ids = torch.stack([torch.randperm(experts + (2 if foreign else 0), generator=gen)[:top_k]
                       for _ in range(tokens)]).clamp(max=experts)
    weights = torch.rand(tokens, top_k, generator=gen)
    want = torch.zeros(tokens, hidden_size)
    for t in range(tokens):
        for j in range(top_k):
            e = int(ids[t, j])
            if e < experts:
                want[t] += float(weights[t, j]) * (silu_and_mul(hidden[t] @ w13[e].T) @ w2[e].T)
    move = lambda t: t.to(DEVICE)   # noqa: E731
    got = fused_moe_planes(move(hidden), [p.to(DEVICE) for p in parts], stack_experts(downs).to(DEVICE),
                           move(weights), move(ids), silu_and_mul)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_experts_of_different_layouts_are_refused():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="share their layout"):
        stack_experts([random_planes(Q4_K, 32, 256, gen), random_planes(Q8_0, 32, 256, gen)])
