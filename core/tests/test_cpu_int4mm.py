"""The CPU's C matmul over torch's int4-packed weights (backends/cpu_int4mm.py) against the weight dequantized and
multiplied in float64, and its declines (None) where torch's op must run instead.

Tolerance: the kernel's only roundings are float32 sums (each group's 32 products, then the groups, the scales
applied in float32) and, for bf16 output, one final rounding. A float32 dot product of K terms is within about
K * 2^-24 * sum|x_k w_k| of the exact one (a loose bound: errors of random signs mostly cancel), so float32 output
is checked against 2 K 2^-24 sum|x w| (+ a tiny absolute term), bf16 output additionally against half a bf16 step
(at most 2^-8 of the value). torch's own op is far from that (its bf16 roundings inside), which the first test
also checks."""

from __future__ import annotations

import pytest
import torch

from cvllm.backends import cpu_int4mm

pytestmark = pytest.mark.skipif(cpu_int4mm.load() is None or cpu_int4mm.load().int4pack_tile() == 0,
                                reason="no C compiler, or a CPU without AVX2 (torch's op runs)")


def tile() -> int:
    return cpu_int4mm.load().int4pack_tile()


def packed_weight(n: int, k: int, seed: int, sz_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = torch.rand(k // 32, n, generator=gen) * 0.02 + 1e-3
    zeros = torch.randn(k // 32, n, generator=gen) * 0.05
    sz = torch.stack([scales, zeros], dim=-1).to(sz_dtype)
    s, z = sz[..., 0].double().t(), sz[..., 1].double().t()   # [N, G]: the values the kernel reads
    weight = ((q.double() - 8).view(n, k // 32, 32) * s[..., None] + z[..., None]).view(n, k)
    return packed, sz, weight


def check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    exact = x.double() @ weight.t()
    magnitude = x.double().abs() @ weight.abs().t()
    bound = 2 * x.shape[1] * 2 ** -24 * magnitude + 1e-9
    if out.dtype == torch.bfloat16:
        bound = bound + exact.abs() * 2 ** -8
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(64, 32), (192, 576), (576, 576), (1536, 576), (576, 1536), (128, 4096)])
def test_matches_the_dequantized_weight(rows, n, k):
    packed, sz, weight = packed_weight(n, k, seed=n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    out = cpu_int4mm.int4pack_mm(x, packed, sz, tile())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    check(out, x, weight)
    theirs = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
    exact = x.double() @ weight.t()
    assert (out.double() - exact).abs().max() <= (theirs.double() - exact).abs().max()


@pytest.mark.parametrize("sz_dtype", [torch.bfloat16, torch.float32])
def test_float32_output_and_float32_scales(sz_dtype):
    packed, sz, weight = packed_weight(256, 512, seed=3, sz_dtype=sz_dtype)
    x = (torch.randn(7, 512, generator=torch.Generator().manual_seed(4)) * 30).bfloat16()
    out = cpu_int4mm.int4pack_mm(x, packed, sz, tile(), torch.float32)
    assert out.dtype == torch.float32
    check(out, x, weight)


def test_declines_what_it_does_not_take():
    """None (the caller runs torch's op) for more rows than MAX_ROWS, float32 activations, a strided input, another
    width or tile, or scales of another layout."""
    packed, sz, _ = packed_weight(192, 576, seed=5)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert cpu_int4mm.int4pack_mm(x, packed, sz, tile()) is not None
    for args in ((torch.randn(17, 576).bfloat16(), packed, sz, tile()), (x.float(), packed, sz, tile()),
                 (torch.randn(576, 4).bfloat16().t(), packed, sz, tile()), (x[:, :64], packed, sz, tile()),
                 (x, packed, sz, 16), (x, packed, sz.transpose(0, 1), tile())):
        assert cpu_int4mm.int4pack_mm(*args) is None


def test_special_values_propagate():
    """A NaN or inf activation poisons its row as in a float matmul (no silent zeros)."""
    packed, sz, _ = packed_weight(64, 64, seed=8)
    x = torch.ones(3, 64, dtype=torch.bfloat16)
    x[1, 5], x[2, 9] = float("nan"), float("inf")
    out = cpu_int4mm.int4pack_mm(x, packed, sz, tile(), torch.float32)
    assert out[0].isfinite().all() and out[1].isnan().all() and not out[2].isfinite().any()
