"""DeepSeek's expert routing as a core routing rule (layers/moe_routing.py), from the config the way transformers
5.24's DeepseekV2TopkRouter and DeepseekV3TopkRouter read it.

- V2 ``greedy``: softmax, top-k. ``group_limited_greedy``: the experts split into ``n_group`` groups, each group
  scored by its best expert; only the ``topk_group`` best groups compete. No renormalisation (transformers' V2).
- V3 ``noaux_tc``: sigmoid scores; the choice uses the scores plus ``e_score_correction_bias``, groups scored by
  the sum of their two best; the weights are the chosen experts' plain scores, renormalised with ``norm_topk_prob``.
Both multiply the weights by ``routed_scaling_factor``.
"""

from __future__ import annotations

from cvllm.config import ModelConfig
from cvllm.layers.moe_routing import TopkRouting


def deepseek_routing(config: ModelConfig, version: int) -> TopkRouting:
    top_k = config.num_experts_per_tok
    if version == 3:
        return TopkRouting(top_k, scoring="sigmoid", renormalize=bool(config.get("norm_topk_prob", True)),
                           scaling=config.routed_scaling_factor, n_group=config.get("n_group") or 1,
                           topk_group=config.get("topk_group") or 1, group_score="top2")
    method = config.get("topk_method") or "greedy"
    scaling = config.get("routed_scaling_factor", 1.0)
    if method == "greedy":
        return TopkRouting(top_k, scaling=scaling)
    if method == "group_limited_greedy":
        return TopkRouting(top_k, scaling=scaling, n_group=config.n_group, topk_group=config.topk_group)
    raise ValueError(f"unsupported DeepSeek-V2 topk_method {method!r} (greedy, group_limited_greedy)")
