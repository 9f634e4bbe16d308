"""How llama.cpp's ``deepseek2`` GGUF files (DeepSeek-V2, V2-Lite, V3, R1) map to the DeepSeek models.

What llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes, and so what loading undoes:

- One architecture name for V2 and V3: ``expert_gating_func`` tells them apart (1 softmax: V2's routing; 2 sigmoid:
  V3's, with the correction bias as ``exp_probs_b.bias``). Group-limited routing when ``expert_group_count`` > 1.
- Two generations of attention tensors and keys. Older files hold ``attn_kv_b`` as the checkpoint has it, with
  ``attention.key_length`` = qk_nope + qk_rope and ``value_length`` = v_head_dim. Files for llama.cpp's MLA
  (since 2025) split it per head into ``attn_k_b`` [H, kv_lora, qk_nope] (transposed) and ``attn_v_b``
  [H, v_head, kv_lora], and say the head sizes in ``key_length_mla`` / ``value_length_mla`` (key_length then
  being kv_lora + qk_rope). The model merges k_b and v_b back into kv_b_proj as it loads.
- Rotary: llama.cpp's "normal" (interleaved pairs) mode on ``rope.dimension_count`` dimensions, rows not permuted;
  YaRN's ``yarn_log_multiplier`` is 0.1 * mscale_all_dim.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cvllm.gguf_adapter import GGUFArchitecture

_MODULES = (
    "model.embed_tokens", "model.norm", "lm_head",
    "model.layers.{bid}.input_layernorm", "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj", "model.layers.{bid}.self_attn.q_a_proj",
    "model.layers.{bid}.self_attn.q_a_layernorm", "model.layers.{bid}.self_attn.q_b_proj",
    "model.layers.{bid}.self_attn.kv_a_proj_with_mqa", "model.layers.{bid}.self_attn.kv_a_layernorm",
    "model.layers.{bid}.self_attn.kv_b_proj", "model.layers.{bid}.self_attn.k_b_proj",
    "model.layers.{bid}.self_attn.v_b_proj", "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj",
    "model.layers.{bid}.mlp.gate", "model.layers.{bid}.mlp.gate.e_score_correction",
    "model.layers.{bid}.mlp.experts.gate_proj", "model.layers.{bid}.mlp.experts.up_proj",
    "model.layers.{bid}.mlp.experts.down_proj",
    "model.layers.{bid}.mlp.shared_experts.gate_proj", "model.layers.{bid}.mlp.shared_experts.up_proj",
    "model.layers.{bid}.mlp.shared_experts.down_proj",
)

_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.q_lora_rank": "q_lora_rank",
    "attention.kv_lora_rank": "kv_lora_rank",
    "rope.freq_base": "rope_theta",
    "rope.dimension_count": "qk_rope_head_dim",
    "context_length": "max_position_embeddings",
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
}

_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
             "first_k_dense_replace": 0, "n_shared_experts": 0, "routed_scaling_factor": 1.0, "n_group": 1,
             "topk_group": 1, "q_lora_rank": None}

SIGMOID_GATING = 2   # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)


def deepseek2_config(raw: dict[str, Any], value: Callable[[str], Any],
                     tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    rope = raw["qk_rope_head_dim"]
    if value("attention.key_length_mla") is not None:   # files for llama.cpp's MLA: k_b / v_b
        raw["qk_nope_head_dim"] = value("attention.key_length_mla") - rope
        raw["v_head_dim"] = value("attention.value_length_mla")
    else:
        raw["qk_nope_head_dim"] = value("attention.key_length") - rope
        raw["v_head_dim"] = value("attention.value_length")
    raw.pop("partial_rotary_factor", None)   # the rope dimensions are their own heads here, not part of one
    if value("expert_gating_func") == SIGMOID_GATING:
        raw["architectures"] = ["DeepseekV3ForCausalLM"]
        raw["topk_method"] = "noaux_tc"
        raw.setdefault("norm_topk_prob", True)
    else:
        raw["architectures"] = ["DeepseekV2ForCausalLM"]
        raw["topk_method"] = "group_limited_greedy" if raw["n_group"] > 1 else "greedy"
    scaling = raw.get("rope_scaling")
    log_multiplier = value("rope.scaling.yarn_log_multiplier")
    if scaling and scaling.get("rope_type") == "yarn" and log_multiplier:
        # DeepSeek's configs give mscale = mscale_all_dim; the file keeps the one as 0.1 * it
        scaling["mscale"] = scaling["mscale_all_dim"] = float(log_multiplier) / 0.1
    return raw


DEEPSEEK2 = GGUFArchitecture(
    hf_architecture="DeepseekV2ForCausalLM",   # or V3: deepseek2_config decides by the gating function
    hf_modules=_MODULES,
    config_keys=_CONFIG_KEYS,
    defaults=_DEFAULTS,
    config_hook="cvllm_deepseek.gguf_adapter:deepseek2_config",
)
