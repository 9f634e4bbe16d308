"""How llama.cpp's Qwen GGUF files (``qwen2``, ``qwen3``, ``qwen2moe``, ``qwen3moe``) map to the Qwen models.

What llama.cpp's converter (convert_hf_to_gguf.py) does for these families, and so what loading undoes:

- q/k rows are written as Hugging Face holds them: Qwen's converters do not inherit LlamaModel's
  rotary permute, so nothing is un-permuted (unlike ``llama``).
- Qwen2 (and Qwen2-MoE) always carry q/k/v biases (``attn_q.bias`` ...); Qwen3 carries them only
  with ``attention_bias`` and has per-head RMSNorms ``attn_q_norm``/``attn_k_norm``, with
  ``attention.key_length`` = head_dim (Qwen3's head_dim is not hidden / heads).
- MoE files stack each layer's experts into one 3-D tensor (``ffn_gate_exps`` ... [experts, out,
  in]); the router is ``ffn_gate_inp``; Qwen2-MoE's shared expert is ``ffn_*_shexp`` with a one-row
  sigmoid gate ``ffn_gate_inp_shexp`` (a 1-D [hidden] in files whose converter squeezed it).
- Every layer is sparse (llama.cpp has no dense MoE layers for these families): decoder_sparse_step
  1, no mlp_only_layers.
- Top-k renormalisation is not in the metadata: llama.cpp's graphs fix it per architecture
  (``build_moe_ffn(..., norm_w=true)`` for qwen3moe, false for qwen2moe), matching the published
  configs (Qwen3-MoE ``norm_topk_prob: true``, Qwen1.5/Qwen2-MoE ``false``). A file that does say
  (``expert_weights_norm``, which other converters write) is believed.
"""

from cvllm.gguf_adapter import GGUFArchitecture

_ATTENTION = (
    "model.embed_tokens",
    "model.norm",
    "lm_head",
    "model.layers.{bid}.input_layernorm",
    "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj",
    "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj",
    "model.layers.{bid}.self_attn.o_proj",
)
_QK_NORMS = ("model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm")
_DENSE_MLP = ("model.layers.{bid}.mlp.gate_proj", "model.layers.{bid}.mlp.up_proj", "model.layers.{bid}.mlp.down_proj")
_EXPERTS = (
    "model.layers.{bid}.mlp.gate",  # the router
    "model.layers.{bid}.mlp.experts.gate_proj",  # stacked: [experts, moe_intermediate, hidden]
    "model.layers.{bid}.mlp.experts.up_proj",
    "model.layers.{bid}.mlp.experts.down_proj",
)
_SHARED_EXPERT = (
    "model.layers.{bid}.mlp.shared_expert_gate",
    "model.layers.{bid}.mlp.shared_expert.gate_proj",
    "model.layers.{bid}.mlp.shared_expert.up_proj",
    "model.layers.{bid}.mlp.shared_expert.down_proj",
)

_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}
_MOE_CONFIG_KEYS = {
    **_CONFIG_KEYS,
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_weights_norm": "norm_topk_prob",
}
# llama.cpp's defaults where a key is optional; sliding windows are not in GGUF and llama.cpp ignores them
_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 32768,
             "use_sliding_window": False}
_MOE_DEFAULTS = {**_DEFAULTS, "decoder_sparse_step": 1, "mlp_only_layers": []}
# converters older than these keys wrote tensors that still say them ([experts, rows, in], [rows, in])
_EXPERT_SHAPES = {
    "num_experts": ("blk.0.ffn_gate_exps.weight", 0),
    "moe_intermediate_size": ("blk.0.ffn_gate_exps.weight", 1),
}

QWEN2 = GGUFArchitecture(
    hf_architecture="Qwen2ForCausalLM",
    hf_modules=(*_ATTENTION, *_DENSE_MLP),
    config_keys=_CONFIG_KEYS,
    defaults=_DEFAULTS,
)

QWEN3 = GGUFArchitecture(
    hf_architecture="Qwen3ForCausalLM",
    hf_modules=(*_ATTENTION, *_QK_NORMS, *_DENSE_MLP),
    config_keys=_CONFIG_KEYS,
    defaults=_DEFAULTS,
    flags_from_tensors={"attention_bias": "blk.0.attn_q.bias"},
)

QWEN2MOE = GGUFArchitecture(
    hf_architecture="Qwen2MoeForCausalLM",
    hf_modules=(*_ATTENTION, *_EXPERTS, *_SHARED_EXPERT),
    config_keys={**_MOE_CONFIG_KEYS, "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    defaults={**_MOE_DEFAULTS, "norm_topk_prob": False},
    flags_from_tensors={"qkv_bias": "blk.0.attn_q.bias"},
    config_from_tensor_shapes={**_EXPERT_SHAPES,
                               "shared_expert_intermediate_size": ("blk.0.ffn_gate_shexp.weight", 0)},
    single_row_weights=("model.layers.{bid}.mlp.shared_expert_gate.weight",),
)

QWEN3MOE = GGUFArchitecture(
    hf_architecture="Qwen3MoeForCausalLM",
    hf_modules=(*_ATTENTION, *_QK_NORMS, *_EXPERTS),
    config_keys=_MOE_CONFIG_KEYS,
    defaults={**_MOE_DEFAULTS, "norm_topk_prob": True},
    flags_from_tensors={"attention_bias": "blk.0.attn_q.bias"},
    config_from_tensor_shapes=_EXPERT_SHAPES,
)
