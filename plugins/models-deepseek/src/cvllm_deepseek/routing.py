"""DeepSeek's expert routing, as transformers 5.24's DeepseekV2TopkRouter and DeepseekV3TopkRouter compute it: each
returns ``[T, k]`` float32 weights and int64 expert ids from the router's float32 logits ``[T, E]``.

- V2 ``greedy``: softmax, top-k. ``group_limited_greedy``: the experts split into ``n_group`` groups, each group
  scored by its best expert; only the ``topk_group`` best groups compete. No renormalisation (transformers' V2).
- V3 ``noaux_tc``: sigmoid scores; the choice uses the scores plus ``e_score_correction_bias`` (the auxiliary-
  loss-free balancing bias), groups scored by the sum of their two best; the weights are the plain scores of the
  chosen experts, renormalised with ``norm_topk_prob``.
Both multiply the weights by ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_scores: torch.Tensor) -> torch.Tensor:
    """bool [T, E]: the experts of each token's ``topk_group`` best groups."""
    tokens, experts = choice.shape
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask[:, :, None].expand(tokens, n_group, experts // n_group).reshape(tokens, experts)


def route_v2(logits: torch.Tensor, top_k: int, method: str, n_group: int | None, topk_group: int | None,
             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        grouped = scores.view(scores.shape[0], n_group, -1).max(dim=-1).values
        scores = scores.masked_fill(~_group_mask(scores, n_group, topk_group, grouped), 0.0)
    elif method != "greedy":
        raise ValueError(f"unsupported DeepSeek-V2 topk_method {method!r} (greedy, group_limited_greedy)")
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * scaling, ids


def route_v3(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
             normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.float().sigmoid()
    choice = scores + bias
    grouped = choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~_group_mask(choice, n_group, topk_group, grouped), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids
