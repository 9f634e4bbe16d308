"""The CUDA router kernel (kernels/moe_routing.py) against core's torch routing (layers/moe_routing.route_topk) for
the rules of the MoE models in scope: the same experts in the same order (best first), the same weights up to the
order of a float32 sum. Triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch

from cvllm.layers.moe_routing import TopkRouting, route_topk
from cvllm_cuda.kernels.moe_routing import route_experts, usable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

RULES = {
    "qwen3-moe": (128, TopkRouting(8, renormalize=True), False),
    "qwen2-moe": (60, TopkRouting(4), False),                       # 60 experts: a padded row of registers
    "deepseek-v2-lite": (64, TopkRouting(6, scaling=1.0), False),    # k = 6: padded slots
    "deepseek-v2": (160, TopkRouting(6, scaling=16.0, n_group=8, topk_group=3), False),
    "deepseek-v3": (256, TopkRouting(8, scoring="sigmoid", renormalize=True, scaling=2.5, n_group=8, topk_group=4,
                                     group_score="top2"), True),
    "v3-one-group": (32, TopkRouting(4, scoring="sigmoid", renormalize=True, scaling=2.5, group_score="top2"), True),
}


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_kernel_matches_the_torch_rule(name, dtype):
    experts, rule, has_bias = RULES[name]
    assert usable(experts, rule)
    gen = torch.Generator().manual_seed(experts)
    logits = (torch.randn(5, experts, generator=gen) * 2).to(dtype)
    bias = torch.randn(experts, generator=gen) * 0.1 if has_bias else None
    want_weights, want_ids = route_topk(logits, bias, rule)
    weights, ids = route_experts(logits.to(DEVICE), None if bias is None else bias.to(DEVICE), rule)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=2e-6, atol=1e-7)


def test_a_strided_row_and_no_tokens():
    rule = TopkRouting(2, renormalize=True)
    logits = torch.randn(3, 16)
    weights, ids = route_experts(logits.t().contiguous().t().to(DEVICE), None, rule)
    want_weights, want_ids = route_topk(logits, None, rule)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights)
    weights, ids = route_experts(torch.empty(0, 16, device=DEVICE), None, rule)
    assert weights.shape == ids.shape == (0, 2)
