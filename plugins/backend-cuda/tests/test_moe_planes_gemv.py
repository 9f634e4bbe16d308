"""The decode-step expert GEMVs over stacked low-bit experts (kernels/moe_planes_gemv.py) against each expert
dequantized (quant_planes.dequantize_planes) and summed in float64, and against the grouped planes GEMM
(fused_moe_planes.py): the plane layouts the GGUF, GPTQ and FP8 repacks use (a/b factors, a high plane, 8-bit, GPTQ
groups with and without act-order input orders, FP8), gate/up as one part and as two, 1 and 2 tokens, top_k 1 to 8,
another rank's expert. Triton's interpreter without a GPU (float32 and float16); compiled, on Qwen3-30B-A3B's expert
shapes, with one."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from cvllm.testing.requirements import import_or_skip

import_or_skip("triton")

from cvllm_cuda.kernels import fused_moe_planes as planes_module  # noqa: E402
from cvllm_cuda.kernels.fused_moe_planes import fused_moe_planes, stack_experts  # noqa: E402
from cvllm_cuda.kernels.moe_planes_gemv import DEFAULT_TILES, PlanesGemvTiles, moe_planes_gemv  # noqa: E402
from cvllm_cuda.quant_planes import QuantLayout, QuantWeight, dequantize_planes, pack_plane  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
needs_gpu = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYOUTS = {   # as the GGUF plugin, the GPTQ repack and the FP8 plugin make them
    "q4_k": QuantLayout(4, 0, 32, 256, a_mode=2, b_mode=2, b_const=-1, has_m=True),
    "q6_k": QuantLayout(4, 2, 16, 256, a_mode=1, b_mode=1, b_const=-32),
    "q8_0": QuantLayout(8, 0, 32, 32, b_const=-128),
    "gptq4_g128": QuantLayout(4, 0, 128, 128, b_mode=2, b_const=-1),
    "fp8_block128": QuantLayout(8, 0, 128, 128, b_const=0, float8=True),
}
# wide tiles keep the interpreter's program count down (two row tiles a pair or token); the default tiles run in
# test_default_tiles_and_masks
# (the interpreter's only: compiled, 128 x 32 tiles of float32 products in 3 stages want 312 KB of shared memory)
FAST = PlanesGemvTiles(gate_up_n=128, gate_up_w=32, down_n=128, down_w=32)
TEST_TILES = FAST if INTERPRET else DEFAULT_TILES


def random_planes(layout: QuantLayout, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    """Weights of magnitude ~0.1 to 1 (small D), so that float16 sums stay far from overflow."""
    q = torch.randint(0, 1 << layout.bits(), (n, k), generator=gen)
    if layout.float8:   # finite e4m3 values only (0x7f and 0xff are NaN)
        q = torch.where((q & 0x7F) == 0x7F, q ^ 0x40, q)
    supers, scales = k // layout.super_group, k // layout.scale_group
    half = lambda: (torch.rand(supers, n, generator=gen) * 9e-4 + 1e-4).half()   # noqa: E731
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class Experts:
    """A layer's stacked planes (``parts`` of gate_up, ``down``, ``perms``) and the float64 weights they hold, each
    expert's inputs in their natural order (``w13 [E, 2I, H]``, ``w2 [E, H, I]``)."""

    def __init__(self, gate_up: list[str], down: str, experts: int, hidden_size: int, inter: int, act_order: bool,
                 gen: torch.Generator):
        rows = [2 * inter] if len(gate_up) == 1 else [inter, inter]
        per_part = [[random_planes(LAYOUTS[name], n, hidden_size, gen) for _ in range(experts)]
                    for name, n in zip(gate_up, rows)]
        downs = [random_planes(LAYOUTS[down], hidden_size, inter, gen) for _ in range(experts)]
        # act-order: the planes hold input perm[e, j] at position j
        sizes = [hidden_size] * len(rows) + [inter]
        perm_lists = [[torch.randperm(k, generator=gen) for _ in range(experts)] if act_order else None
                      for k in sizes]
        self.parts, self.down = [stack_experts(p) for p in per_part], stack_experts(downs)
        self.perms = [torch.stack(p).int() if p else None for p in perm_lists] if act_order else None

        def natural(weights, perms):   # [E, N, K] in the inputs' own order
            stacked = torch.stack([dequantize_planes(w).double() for w in weights])
            if perms is None:
                return stacked
            out = torch.empty_like(stacked)
            for e, perm in enumerate(perms):
                out[e][:, perm] = stacked[e]
            return out

        self.w13 = torch.cat([natural(p, perm_lists[i]) for i, p in enumerate(per_part)], dim=1)
        self.w2 = natural(downs, perm_lists[-1])

    def on(self, device: str) -> tuple:
        perms = [p.to(device) if p is not None else None for p in self.perms] if self.perms else None
        return [p.to(device) for p in self.parts], self.down.to(device), perms


def reference(experts: Experts, hidden, weights, ids) -> torch.Tensor:
    """float64: each pair's down(silu(gate) * up) times its weight, summed per token (ids >= E add nothing)."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < experts.w13.shape[0]:
                out[t] += float(weights[t, j]) * (silu_and_mul(experts.w13[e] @ hidden[t].double()) @ experts.w2[e].T)
    return out


def routing(tokens: int, top_k: int, experts: int, foreign: bool, gen: torch.Generator):
    """ids [T, k] (distinct per token; with ``foreign`` the first token's last pair is another rank's, id E)."""
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    if foreign:
        ids[0, -1] = experts
    return torch.rand(tokens, top_k, generator=gen), ids


def grouped(*args) -> torch.Tensor:
    """fused_moe_planes with the expert GEMVs off: the grouped planes GEMM."""
    saved = planes_module.PAIR_GEMV_MAX
    planes_module.PAIR_GEMV_MAX = 0
    try:
        return fused_moe_planes(*args)
    finally:
        planes_module.PAIR_GEMV_MAX = saved


def assert_float32_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 sums of ~256 products in another order than the reference's, through two GEMVs: a few 1e-7 of the
    output's scale (measured ~1e-6 at worst); 2e-5 of it still catches any wrong weight or input (~1e-2)."""
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=0, atol=2e-5 * scale)


CASES = [   # (gate_up part layouts, down layout, act-order)
    (["q4_k"], "q6_k", False),
    (["q8_0", "q8_0"], "q4_k", False),
    (["q4_k", "q8_0"], "q8_0", False),            # gate and up in two layouts (a GGUF mix)
    (["gptq4_g128", "gptq4_g128"], "gptq4_g128", False),
    (["gptq4_g128", "gptq4_g128"], "gptq4_g128", True),
    (["gptq4_g128"], "gptq4_g128", True),
    (["fp8_block128"], "fp8_block128", False),
]


@pytest.mark.parametrize("gate_up, down, act_order", CASES, ids=lambda c: "+".join(c) if isinstance(c, list) else
                         str(c))
def test_expert_gemvs_match_the_dequantized_experts_and_the_grouped_gemm(gate_up, down, act_order):
    gen = torch.Generator().manual_seed(len(gate_up) * 7 + len(down) + act_order)
    num_experts, hidden_size, inter = 8, 256, 256
    experts = Experts(gate_up, down, num_experts, hidden_size, inter, act_order, gen)
    parts, down_planes, perms = experts.on(DEVICE)
    # 16 pairs: PAIR_GEMV_MAX; the grouped GEMM (slow in the interpreter) on the middle case only
    for tokens, top_k, foreign in [(1, 1, False), (2, 2, True), (2, 8, False)]:
        hidden = torch.randn(tokens, hidden_size, generator=gen)
        weights, ids = routing(tokens, top_k, num_experts, foreign, gen)
        args = [hidden.to(DEVICE), parts, down_planes, weights.to(DEVICE), ids.to(DEVICE)]
        got = moe_planes_gemv(*args, perms, tiles=TEST_TILES)
        assert_float32_close(got, reference(experts, hidden, weights, ids))
        if foreign:
            assert_float32_close(got, grouped(*args, silu_and_mul, perms).double())


def test_default_tiles_and_masks(monkeypatch):
    """fused_moe_planes' dispatch to the expert GEMVs (on unless CVLLM_MOE_PLANES_GEMV=0) with their default tiles,
    top_k 6 (pair slots past k masked), and a Q8_0 shape whose rows and K steps do not fill the tiles
    (the masked loads)."""
    monkeypatch.setattr(planes_module, "PAIR_GEMV_MAX", 16)
    gen = torch.Generator().manual_seed(6)
    for hidden_size, inter in [(256, 256), (96, 160)]:
        layout = "q6_k" if hidden_size % 256 == 0 else "q8_0"
        experts = Experts([layout], layout, 8, hidden_size, inter, False, gen)
        parts, down_planes, _ = experts.on(DEVICE)
        hidden = torch.randn(1, hidden_size, generator=gen)
        weights, ids = routing(1, 6, 8, False, gen)
        got = fused_moe_planes(hidden.to(DEVICE), parts, down_planes, weights.to(DEVICE), ids.to(DEVICE),
                               silu_and_mul)
        assert_float32_close(got, reference(experts, hidden, weights, ids))


def rounded_reference(experts: Experts, hidden, weights, ids) -> torch.Tensor:
    """The pairwise sum with the grouped path's roundings in the activations' dtype (each part's sums, silu and its
    product with up, the expert's output, its product with the weight), the k products summed in float32."""
    dtype, inter = hidden.dtype, experts.w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= experts.w13.shape[0]:
                continue
            gate_up = (experts.w13[e] @ hidden[t].double()).to(dtype).float()
            inner = (F.silu(gate_up[:inter]).to(dtype).float() * gate_up[inter:]).to(dtype)
            down = (experts.w2[e] @ inner.double()).to(dtype)
            out[t] += (down * weights[t, j].to(dtype)).float()
    return out.to(dtype)


def check_rounding(experts: Experts, tokens: int, top_k: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    parts, down_planes, perms = experts.on(DEVICE)
    hidden = torch.randn(tokens, experts.w13.shape[2], generator=gen).to(dtype)
    weights, ids = routing(tokens, top_k, experts.w13.shape[0], True, gen)
    got = moe_planes_gemv(hidden.to(DEVICE), parts, down_planes, weights.to(DEVICE), ids.to(DEVICE), perms,
                          tiles=TEST_TILES)
    want = rounded_reference(experts, hidden, weights, ids)
    assert got.dtype == dtype
    # float32 sums in another order flip a rounding to the dtype now and then (an inner value or an expert's
    # output, by one unit in the last place): such an output is off by about an ulp of its products' scale, and the
    # rest are equal bit for bit (measured in float16: 1 output in 128 off; the float64 sum rounded once differs
    # from this reference in 2 of 3 outputs). One inner value flipped on a near-tie moves every output of its pair a
    # little and so some of them across a rounding step: on the H200 (Qwen3 shape, the GGUF mix, bfloat16, 1 token)
    # one pair of 8 differed in 35% of its outputs by one ulp, 17% of the sum's; the other cases 0-3%.
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -11)
    got = got.cpu()
    assert (got != want).float().mean().item() < 0.25
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=2 * ulp * want.abs().max().item())


def test_float16_rounds_as_the_grouped_path():
    """Triton's interpreter rounds to float16 as the GPU does (bfloat16 it truncates: compiled only, below)."""
    experts = Experts(["q4_k"], "q6_k", 8, 256, 256, False, torch.Generator().manual_seed(11))
    check_rounding(experts, 2, 8, torch.float16, seed=12)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("gate_up, down, act_order", [CASES[0], CASES[2], CASES[4]], ids=["q4_k", "mix", "act_order"])
@pytest.mark.parametrize("tokens", [1, 2])
def test_compiled_on_qwen3_moe_shapes(gate_up, down, act_order, dtype, tokens):
    experts = Experts(gate_up, down, 16, 2048, 768, act_order, torch.Generator().manual_seed(1))
    check_rounding(experts, tokens, 8, dtype, seed=tokens)
