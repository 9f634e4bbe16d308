"""How llama.cpp's Phi GGUF files (``phi2``, ``phi3``) map to the Phi models.

What llama.cpp's converter (convert_hf_to_gguf.py) writes for these families, and so what loading reads:

- q/k rows as Hugging Face holds them (no rotary permute). Phi-2 keeps separate ``attn_q``/``attn_k``/``attn_v``
  with biases, ``attn_output`` (``dense``), ``ffn_up``/``ffn_down`` (``fc1``/``fc2``) with biases, LayerNorms
  with biases and an ``output`` with a bias. Phi-3 keeps the checkpoint's fused ``attn_qkv`` and its fused
  gate+up as ``ffn_up``; Phi3ForCausalLM's weight transforms cut both (their rows of blocks, when quantized)
  into the q/k/v and gate/up shards of its fused layers, which stay in their blocks like the others.
- The rotary width is ``rope.dimension_count`` (``partial_rotary_factor`` = that / head_dim: Phi-2's 0.4,
  Phi-4-mini's 0.75), read by the GGUF plugin. Phi-3 also writes ``attention.sliding_window`` and
  ``rope.scaling.original_context_length``.
- LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) lives in two F32 tensors, ``rope_factors_long``/``rope_factors_short``
  (one factor per rotated pair), with ``rope.scaling.original_context_length`` and the converter's
  ``rope.scaling.attn_factor``: the config hook reads them back into a longrope ``rope_scaling``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cvllm.gguf_adapter import GGUFArchitecture

_CONFIG_KEYS = {
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
}

PHI2 = GGUFArchitecture(
    hf_architecture="PhiForCausalLM",
    hf_modules=(
        "model.embed_tokens",
        "model.final_layernorm",
        "lm_head",
        "model.layers.{bid}.input_layernorm",
        "model.layers.{bid}.self_attn.q_proj",
        "model.layers.{bid}.self_attn.k_proj",
        "model.layers.{bid}.self_attn.v_proj",
        "model.layers.{bid}.self_attn.dense",
        "model.layers.{bid}.mlp.fc1",
        "model.layers.{bid}.mlp.fc2",
    ),
    config_keys={**_CONFIG_KEYS, "attention.layer_norm_epsilon": "layer_norm_eps"},
    # llama.cpp's phi2 graph: tanh GELU, base 10000 (the converter writes no freq_base)
    defaults={"hidden_act": "gelu_new", "layer_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 2048},
)

LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def phi3_config(raw: dict[str, Any], value: Callable[[str], Any], tensors: Mapping[str, tuple[int, ...]],
                read_tensor: Callable[[str], Any]) -> dict[str, Any]:
    """A LongRoPE file's rope_scaling, as the Hugging Face config had it (convert_hf_to_gguf wrote the factors as
    tensors, the original context and the attention factor as metadata)."""
    present = [name in tensors for name in LONGROPE_TENSORS]
    if not any(present):
        return raw
    if not all(present):
        raise ValueError(f"LongRoPE needs both {' and '.join(LONGROPE_TENSORS)}; the file has one")
    long, short = (read_tensor(name).float().reshape(-1).tolist() for name in LONGROPE_TENSORS)
    scaling: dict[str, Any] = {"type": "longrope", "long_factor": long, "short_factor": short}
    if value("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(value("rope.scaling.attn_factor"))
    raw["rope_scaling"] = scaling   # (config_keys took the original context)
    return raw


PHI3 = GGUFArchitecture(
    hf_architecture="Phi3ForCausalLM",
    hf_modules=(
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        "model.layers.{bid}.input_layernorm",
        "model.layers.{bid}.post_attention_layernorm",
        "model.layers.{bid}.self_attn.qkv_proj",
        "model.layers.{bid}.self_attn.o_proj",
        "model.layers.{bid}.mlp.gate_up_proj",
        "model.layers.{bid}.mlp.down_proj",
    ),
    config_keys={**_CONFIG_KEYS, "attention.layer_norm_rms_epsilon": "rms_norm_eps",
                 "attention.sliding_window": "sliding_window",
                 "rope.scaling.original_context_length": "original_max_position_embeddings"},
    defaults={"hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096},
    config_hook="cvllm_phi.gguf_adapter:phi3_config",
    ignored_tensors=("rope_factors_long", "rope_factors_short"),   # read by phi3_config, not weights
)
