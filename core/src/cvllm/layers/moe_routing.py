"""Which experts a token goes to: the top-k routing rules of the MoE models in scope, as one description.

``TopkRouting`` holds a rule; calling it on the router's logits ``[T, E]`` returns ``[T, k]`` float32 weights and
int64 expert ids. The torch code below is the reference; a backend with ``route_experts`` (CUDA: one Triton
launch instead of the ~6 kernels of softmax, topk, sum and divide) returns the same numbers.

- Qwen2/3-MoE, Mixtral-style: softmax, top-k, optionally renormalised to sum 1.
- DeepSeek-V2 ``greedy`` / ``group_limited_greedy``: softmax; with groups, each group scored by its best expert
  and only the ``topk_group`` best groups compete (the others' scores set to 0, as transformers does).
- DeepSeek-V3 ``noaux_tc``: sigmoid scores; the choice uses the scores plus ``e_score_correction_bias``, groups
  scored by the sum of their two best (the others' set to -inf); the weights are the plain scores of the chosen
  experts, renormalised with ``norm_topk_prob``.
The weights are then multiplied by ``scaling`` (DeepSeek's ``routed_scaling_factor``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cvllm.backends.base import forward_backend


@dataclass(frozen=True, slots=True)
class TopkRouting:
    top_k: int
    scoring: str = "softmax"      # or "sigmoid"
    renormalize: bool = False     # divide the chosen weights by their sum
    scaling: float = 1.0
    n_group: int = 1              # > 1: group-limited routing
    topk_group: int = 1
    group_score: str = "max"      # a group's score: its best expert ("max", V2) or the sum of its best two ("top2")

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid") or self.group_score not in ("max", "top2"):
            raise ValueError(f"unsupported routing {self}")

    def __call__(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [T, E]`` (any float dtype), ``bias`` float32 [E] (V3's correction) or None."""
        backend = forward_backend()
        if backend is not None and backend.route_experts is not None:
            return backend.route_experts(logits, bias, self)
        return route_topk(logits, bias, self)


def _group_mask(choice: torch.Tensor, rule: TopkRouting) -> torch.Tensor:
    """bool [T, E]: the experts of each token's ``topk_group`` best groups."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, rule.n_group, -1)
    scores = grouped.max(dim=-1).values if rule.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(scores, k=rule.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand(tokens, rule.n_group, experts // rule.n_group).reshape(tokens, experts)


def route_topk(logits: torch.Tensor, bias: torch.Tensor | None, rule: TopkRouting) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference computation of ``rule(logits, bias)`` (transformers' order of operations)."""
    if rule.scoring == "softmax":
        scores = logits.softmax(dim=-1, dtype=torch.float32)
    else:
        scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias
    if rule.n_group > 1:
        # a group left out: 0 for V2's scores (transformers' masked_fill), -inf for V3's biased choice
        fill = 0.0 if rule.group_score == "max" else float("-inf")
        choice = choice.masked_fill(~_group_mask(choice, rule), fill)
    weights, ids = torch.topk(choice, k=rule.top_k, dim=-1)   # best first
    if bias is not None:   # chosen by the biased score, weighted by the plain one
        weights = scores.gather(1, ids)
    if rule.renormalize:
        # + 1e-20 as DeepSeek-V3 does: it only matters for an all-zero row, a no-op on sums of softmax weights
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * rule.scaling if rule.scaling != 1.0 else weights), ids
