"""How llama.cpp's StableLM GGUF files (``stablelm``) map to StableLmForCausalLM.

What llama.cpp's converter (convert_hf_to_gguf.py, StableLMModel) does, and so what loading undoes:

- q/k rows are written as Hugging Face holds them (llama.cpp's "neox" rope mode, no permute);
- ``rope.dimension_count`` is head_dim x partial_rotary_factor, which the GGUF plugin turns back into the factor
  when it differs from head_dim (a file without it rotates the whole head in llama.cpp: default 1.0 here);
- the per-head q/k LayerNorms (``norms.{head}.weight``) are stacked into one ``attn_q_norm``/``attn_k_norm``
  [heads, head_dim] each; the model splits them back while loading;
- the converter writes ``use_parallel_residual`` as True when config.json does not say, while llama.cpp's graph
  decides by the tensors: a layer without ``ffn_norm`` (post_attention_layernorm) is the parallel form. So does
  ``residual_form_from_tensors`` here;
- biases: ``attn_q.bias`` ... with ``use_qkv_bias``, every LayerNorm's bias (``attn_norm.bias`` ...).
"""

from collections.abc import Callable, Mapping
from typing import Any

from cvllm.gguf_adapter import GGUFArchitecture


def residual_form_from_tensors(raw: dict[str, Any], value: Callable[[str], Any],
                               tensors: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    raw["use_parallel_residual"] = "blk.0.ffn_norm.weight" not in tensors
    return raw


STABLELM = GGUFArchitecture(
    hf_architecture="StableLmForCausalLM",
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
        "model.layers.{bid}.self_attn.q_layernorm",
        "model.layers.{bid}.self_attn.k_layernorm",
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
        "attention.layer_norm_epsilon": "layer_norm_eps",
        "rope.freq_base": "rope_theta",
        "context_length": "max_position_embeddings",
    },
    defaults={"hidden_act": "silu", "layer_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
              "partial_rotary_factor": 1.0},
    flags_from_tensors={"use_qkv_bias": "blk.0.attn_q.bias", "qk_layernorm": "blk.0.attn_q_norm.weight"},
    config_hook="cvllm_stablelm.gguf_adapter:residual_form_from_tensors",
)
