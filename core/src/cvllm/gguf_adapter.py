"""What a model plugin declares so that GGUF files of its family load (``register_gguf_architectures``).

A GGUF file names its family in ``general.architecture`` (``"llama"``) and stores llama.cpp's
names and conventions. The GGUF plugin turns it into a Hugging Face config and HF-named tensors;
the per-family facts it needs are this small declarative record, so a model plugin supplies them
without importing the GGUF plugin (plugins never import each other), and a new family ships its
GGUF support with its own plugin::

    register("llama", "cvllm_llama.gguf_adapter:LLAMA")

Stacked expert tensors (llama.cpp's ``ffn_gate_exps`` ..., one 3-D tensor per layer, [experts, out,
in] in Hugging Face order) are declared like any module, by the name gguf's ``TensorNameMap`` knows
(``"model.layers.{bid}.mlp.experts.gate_proj"``); the GGUF plugin yields them under that name
without a ``.weight`` suffix, which is the stacked form ``FusedMoE``'s weight loader takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    # config.json "architectures"[0] of the model class that runs these files, e.g. "LlamaForCausalLM"
    hf_architecture: str
    # the Hugging Face module names whose weights the model loads, "{bid}" standing for the block
    # index (e.g. "model.layers.{bid}.self_attn.q_proj"); the GGUF plugin looks each up in gguf's
    # TensorNameMap to find its GGUF name, so only names of this family are ever produced
    hf_modules: tuple[str, ...]
    # GGUF metadata key without the "<architecture>." prefix -> HF config key,
    # e.g. {"embedding_length": "hidden_size", "attention.head_count": "num_attention_heads"}
    config_keys: Mapping[str, str]
    # HF config values used when the metadata does not say (e.g. {"hidden_act": "silu"})
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # HF config keys set to True when the GGUF tensor named here is present, False otherwise
    # (e.g. {"attention_bias": "blk.0.attn_q.bias"})
    flags_from_tensors: Mapping[str, str] = field(default_factory=dict)
    # HF config keys read from a tensor's shape when the metadata does not say: key -> (GGUF tensor
    # name, dimension in Hugging Face order). Older converters left out keys the tensors still
    # imply, e.g. {"moe_intermediate_size": ("blk.0.ffn_gate_exps.weight", 1)} ([experts, rows, in])
    config_from_tensor_shapes: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    # Hugging Face weights of one row ([1, n], "{bid}" for the block) that a GGUF file may hold as a
    # 1-D [n] (ggml drops trailing 1s; llama.cpp's older converters squeezed such tensors); they load
    # as [1, n], e.g. Qwen2-MoE's "model.layers.{bid}.mlp.shared_expert_gate.weight"
    single_row_weights: tuple[str, ...] = ()
    # llama.cpp's converter permutes the rows of q and k (rotary pairs interleaved) for this family
    permute_qk: bool = False
    # no "output.weight" in the file means the LM head is the token embedding
    tied_embeddings_when_no_output: bool = True
    # a "rope_freqs" tensor holds llama.cpp's per-dimension llama3 rope factors; rebuild rope_scaling
    llama3_rope_freqs: bool = False
    # GGUF tensor names (with "{bid}") that carry no model weight and are skipped
    ignored_tensors: tuple[str, ...] = ()
    # "module:function" of the model plugin, called last as function(raw, value, tensors) -> raw for what the
    # records above cannot say (DeepSeek: head sizes from two generations of keys, the routing by gating
    # function, the architecture V2 or V3); value(key) reads a key without the "<arch>." prefix (None: absent),
    # tensors maps GGUF tensor names to their shapes; a hook with a ``read_tensor`` parameter also gets
    # read_tensor(name) -> the float32 values of a (small) GGUF tensor (Phi-3's LongRoPE factors)
    config_hook: str | None = None
