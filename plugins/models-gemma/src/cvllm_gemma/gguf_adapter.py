"""How llama.cpp's Gemma GGUF files (``gemma``, ``gemma2``, ``gemma3``) map to the Gemma models.

What llama.cpp's converter (convert_hf_to_gguf.py, GemmaModel / Gemma2Model / Gemma3Model) does, and so what
loading undoes or fills in:

- every ``*norm.weight`` is written with Gemma's 1 added (``data_torch + 1``; Gemma 3's q/k norms too), so the
  file holds the RMSNorm's whole scale: the config says ``NORM_SHIFT`` and the models subtract it while loading
  (exact in fp32 for scales in [0.5, 2]), keeping one (1 + w) norm for both kinds of checkpoint;
- q/k rows as Hugging Face holds them (Gemma's converters do not inherit LlamaModel's permute); no output.weight
  (the LM head is the embedding);
- no ``query_pre_attn_scalar``: llama.cpp scales queries by head_dim ** -0.5, and by (hidden / heads) ** -0.5 in
  the 27B models, which it tells by their layer count (Gemma 2: 46, Gemma 3: 62); that is what the published
  configs say (256 = head_dim for 2B/9B and 1B-12B; 144 and 168 = hidden / heads for the 27Bs);
- Gemma 2: the soft-caps and the window are in the metadata; layers alternate local/global from layer 0 (llama.cpp's
  swa pattern 2, transformers' rule);
- Gemma 3: ``rope.freq_base`` and the linear ``rope.scaling`` are the global layers'; the local base (10000) and
  the pattern (one global layer in 6) are llama.cpp's fixed values, the published ones.
"""

from cvllm.gguf_adapter import GGUFArchitecture

# config key: what the file's norm weights hold beyond Gemma's (1 + w) offset w (llama.cpp's "norm_shift")
NORM_SHIFT = "gguf_norm_shift"

_GEMMA = (
    "model.embed_tokens",
    "model.norm",
    "model.layers.{bid}.input_layernorm",
    "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.q_proj",
    "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj",
    "model.layers.{bid}.self_attn.o_proj",
    "model.layers.{bid}.mlp.gate_proj",
    "model.layers.{bid}.mlp.up_proj",
    "model.layers.{bid}.mlp.down_proj",
)
_SANDWICH = ("model.layers.{bid}.pre_feedforward_layernorm", "model.layers.{bid}.post_feedforward_layernorm")
_QK_NORMS = ("model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm")

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
_SLIDING_KEYS = {**_CONFIG_KEYS, "attention.sliding_window": "sliding_window"}
# llama.cpp's values where a key is optional or fixed per architecture (llama-model.cpp's load_hparams)
_DEFAULTS = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, NORM_SHIFT: 1.0}
# the layer count llama.cpp takes for its 27B type, whose queries it scales by hidden / heads
_LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}

GEMMA = GGUFArchitecture(
    hf_architecture="GemmaForCausalLM",
    hf_modules=_GEMMA,
    config_keys=_CONFIG_KEYS,
    defaults=_DEFAULTS,
)

GEMMA2 = GGUFArchitecture(
    hf_architecture="Gemma2ForCausalLM",
    hf_modules=(*_GEMMA, *_SANDWICH),
    config_keys={**_SLIDING_KEYS, "attn_logit_softcapping": "attn_logit_softcapping",
                 "final_logit_softcapping": "final_logit_softcapping"},
    defaults={**_DEFAULTS, "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    config_hook="cvllm_gemma.gguf_adapter:query_scale_as_llama_cpp",
)

GEMMA3 = GGUFArchitecture(
    hf_architecture="Gemma3ForCausalLM",
    hf_modules=(*_GEMMA, *_SANDWICH, *_QK_NORMS, "lm_head"),
    config_keys={**_SLIDING_KEYS, "rope.freq_base_swa": "rope_local_base_freq"},
    defaults={**_DEFAULTS, "rope_local_base_freq": 10000.0, "sliding_window_pattern": 6,
              "final_logit_softcapping": None},
    config_hook="cvllm_gemma.gguf_adapter:query_scale_as_llama_cpp",
)


def query_scale_as_llama_cpp(raw: dict, value, tensors) -> dict:
    """``query_pre_attn_scalar`` as llama.cpp chooses the scale: hidden / heads in the 27B models, else
    head_dim."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    is_27b = raw["num_hidden_layers"] == _LAYERS_OF_27B.get(raw["model_type"])
    raw["query_pre_attn_scalar"] = raw["hidden_size"] // raw["num_attention_heads"] if is_27b else head_dim
    return raw
