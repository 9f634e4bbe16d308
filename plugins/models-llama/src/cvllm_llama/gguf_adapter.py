"""How llama.cpp's ``llama`` GGUF files (Llama 1/2/3, Mistral, Yi, SmolLM ...) map to LlamaForCausalLM."""

from cvllm.gguf_adapter import GGUFArchitecture

LLAMA = GGUFArchitecture(
    hf_architecture="LlamaForCausalLM",
    hf_modules=(
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        "model.layers.{bid}.input_layernorm",
        "model.layers.{bid}.post_attention_layernorm",
        "model.layers.{bid}.self_attn.q_proj",
        "model.layers.{bid}.self_attn.k_proj",
        "model.layers.{bid}.self_attn.v_proj",
        "model.layers.{bid}.self_attn.o_proj",
        "model.layers.{bid}.mlp.gate_proj",
        "model.layers.{bid}.mlp.up_proj",
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
    defaults={"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096},
    flags_from_tensors={"attention_bias": "blk.0.attn_q.bias", "mlp_bias": "blk.0.ffn_up.bias"},
    # convert_hf_to_gguf's LlamaModel.permute interleaves the rotary halves of each q/k head
    permute_qk=True,
    # Llama 3.1+ files carry llama3 rope scaling only as this per-dimension factor tensor
    llama3_rope_freqs=True,
    ignored_tensors=("rope_freqs", "blk.{bid}.attn_rot_embd"),
)
