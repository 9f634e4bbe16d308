"""A MoE router's top-k choice in one Triton launch: core's ``route_topk`` (layers/moe_routing.py) for every rule
it describes (softmax or sigmoid scores, V3's correction bias, group-limited choice, renormalisation, scaling).

The torch code is ~6 kernels a layer (softmax, topk's two, sum, divide, multiply), each a few microseconds at
batch 1, where the experts' weights of a Qwen3-30B-A3B layer stream in ~25: a program per token here holds the
token's E scores in registers and picks the k best by k argmax passes, best first (torch.topk's order; a tie
goes to the lower expert id). float32 throughout; softmax's exp from libdevice like torch's, so the scores are
torch's up to the order of the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from cvllm_cuda.kernels import pdl
from cvllm_cuda.kernels.pdl import wait_for_previous_kernel
from cvllm_cuda.kernels.sizes import next_power_of_2

_LIBDEVICE_EXP = not triton.knobs.runtime.interpret   # the interpreter has no libdevice: numpy's exp there


@triton.jit
def _exp(x, LIBDEVICE_EXP: tl.constexpr):
    if LIBDEVICE_EXP:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, stride_lt, scaling,
                  TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                  N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, LIBDEVICE_EXP: tl.constexpr,
                  USE_PDL: tl.constexpr):
    wait_for_previous_kernel(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    ok = experts < E
    x = tl.load(logits_ptr + token * stride_lt + experts, mask=ok, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        p = _exp(x - tl.max(x, axis=0), LIBDEVICE_EXP)
        scores = tl.math.div_rn(p, tl.sum(p, axis=0))
    else:
        scores = tl.math.div_rn(1.0, 1.0 + _exp(-x, LIBDEVICE_EXP))
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + experts, mask=ok, other=0.0)
    choice = tl.where(ok, choice, float("-inf"))
    if N_GROUP > 1:
        # each group's score (its best, or its best two summed), then the TOPK_GROUP best groups stay
        group_of = experts // (E // N_GROUP)
        groups = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            member = tl.where(group_of == g, choice, float("-inf"))
            best = tl.max(member, axis=0)
            if GROUP_TOP2:
                first = tl.argmax(member, axis=0)
                best += tl.max(tl.where(experts == first, float("-inf"), member), axis=0)
            group_scores = tl.where(groups == g, best, group_scores)
        kept = tl.zeros((BLOCK_E,), tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            g = tl.argmax(group_scores, axis=0)
            kept |= group_of == g
            group_scores = tl.where(groups == g, float("-inf"), group_scores)
        # a group left out: 0 for softmax scores (transformers' V2), -inf for V3's biased choice
        choice = tl.where(kept & ok, choice, float("-inf") if GROUP_TOP2 else 0.0)
    chosen_weights = tl.zeros((BLOCK_K,), tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), tl.int64)
    slots = tl.arange(0, BLOCK_K)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        hit = experts == best
        # V3 weighs by the plain score; otherwise the choice is the weight (V2's masked 0 included)
        weight = tl.sum(tl.where(hit, scores if HAS_BIAS else choice, 0.0), axis=0)
        chosen_weights = tl.where(slots == j, weight, chosen_weights)
        chosen_ids = tl.where(slots == j, best.to(tl.int64), chosen_ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:
        chosen_weights = tl.math.div_rn(chosen_weights, tl.sum(chosen_weights, axis=0) + 1e-20)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids, mask=slots < TOP_K)


def usable(num_experts: int, rule) -> bool:
    """Shapes the kernel takes: up to 1024 experts (a row of registers), whole groups of two or more."""
    return (rule.top_k <= num_experts <= 1024
            and (rule.n_group == 1 or (num_experts % rule.n_group == 0 and num_experts // rule.n_group >= 2)))


def route_experts(logits: torch.Tensor, bias: torch.Tensor | None, rule) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA backend's ``route_experts``: ``rule(logits, bias)`` (a core TopkRouting) in one launch, or core's
    torch code for the shapes the kernel does not take."""
    tokens, num_experts = logits.shape
    if not usable(num_experts, rule):
        from cvllm.layers.moe_routing import route_topk

        return route_topk(logits, bias, rule)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((tokens, rule.top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, rule.top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    _route_kernel[(tokens,)](
        logits, bias if bias is not None else logits, weights, ids, num_experts, logits.stride(0), float(rule.scaling),
        TOP_K=rule.top_k, SOFTMAX=rule.scoring == "softmax", HAS_BIAS=bias is not None, RENORMALIZE=rule.renormalize,
        N_GROUP=rule.n_group, TOPK_GROUP=rule.topk_group, GROUP_TOP2=rule.group_score == "top2",
        BLOCK_E=next_power_of_2(num_experts), BLOCK_G=next_power_of_2(rule.n_group),
        BLOCK_K=next_power_of_2(rule.top_k), LIBDEVICE_EXP=_LIBDEVICE_EXP,
        num_warps=1 if num_experts <= 256 else 4, enable_fp_fusion=False,   # argmax within a warp: shuffles only
        **pdl.options(logits.device),
    )
    return weights, ids
