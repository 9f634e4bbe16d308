"""How llama.cpp's GLM-4-0414 GGUF files (``glm4``) map to Glm4ForCausalLM.

What llama.cpp's converter (convert_hf_to_gguf.py, Glm4Model) does, and so what loading undoes:

- q/k rows are written as Hugging Face holds them (no rotary permute): llama.cpp's "normal" rope mode for glm4
  turns adjacent pairs, the interleaved rotary the model already applies;
- ``rope.dimension_count`` is head_dim x partial_rotary_factor; the GGUF plugin turns it back into the factor when
  it differs from head_dim. A file without it rotates the whole head in llama.cpp, so the default here is 1.0, not
  the model's 0.5 for a config.json that names no factor;
- the fused ``gate_up_proj`` is ``ffn_up`` ([2 x intermediate, hidden], gate rows first), loaded whole and split by
  the model as a safetensors checkpoint's; the four norms are attn_norm, post_attention_norm (after attention),
  ffn_norm (before the MLP) and post_ffw_norm;
- q/k/v biases are there when the model has them (``attention_bias``), o_proj has none.

llama.cpp names GLM-4's pre-tokenizer ``glm4`` (``chatglm-bpe`` for glm-4-9b), which the GGUF plugin's tokenizer
does not know yet: the tests here use a tokenizer it knows.
"""

from cvllm.gguf_adapter import GGUFArchitecture

GLM4 = GGUFArchitecture(
    hf_architecture="Glm4ForCausalLM",
    hf_modules=(
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        "model.layers.{bid}.input_layernorm",
        "model.layers.{bid}.post_self_attn_layernorm",
        "model.layers.{bid}.post_attention_layernorm",
        "model.layers.{bid}.post_mlp_layernorm",
        "model.layers.{bid}.self_attn.q_proj",
        "model.layers.{bid}.self_attn.k_proj",
        "model.layers.{bid}.self_attn.v_proj",
        "model.layers.{bid}.self_attn.o_proj",
        "model.layers.{bid}.mlp.gate_up_proj",
        "model.layers.{bid}.mlp.down_proj",
    ),
    config_keys={
        "embedding_length": "hidden_size",
        "feed_forward_length": "intermediate_size",
        "block_count": "num_hidden_layers",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.key_length": "head_dim",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "rope.freq_base": "rope_theta",
        "context_length": "max_position_embeddings",
    },
    defaults={"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 32768,
              "partial_rotary_factor": 1.0},
    flags_from_tensors={"attention_bias": "blk.0.attn_q.bias"},
)
