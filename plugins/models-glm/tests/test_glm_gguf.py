"""GLM-4-0414 GGUF files (glm4) against transformers on the same tiny weights.

Each case builds a tiny random Glm4ForCausalLM and writes it as llama.cpp's converter would (names, metadata with
rope.dimension_count = head_dim x partial_rotary_factor, the fused gate_up_proj as ffn_up, a gpt2-style tokenizer):
once all F32, once with Q8_0 linear weights. cvllm's config derived from the GGUF must say what transformers' does,
the fused ffn_up must stay in its Q8_0 blocks, and cvllm's float32 (exact path) prompt logits and greedy tokens
must equal transformers' on the weights the file holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from cvllm import LLM, plugins
from cvllm.testing import PAD_TOKEN_ID, hf_logits
from cvllm.testing.checkpoints import BASE_CONFIG, randomize_norms_and_biases
from cvllm_gguf.testing import (
    add_common_hyperparameters,
    add_tensor,
    add_tiny_tokenizer,
    hf_to_gguf_name,
    write_file,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CASES: dict[str, dict[str, Any]] = {
    "biases_head_dim": {"head_dim": 32},   # head_dim != hidden / heads: the converter writes key_length
    "no_bias_tied": {"attention_bias": False, "tie_word_embeddings": True, "partial_rotary_factor": 0.25},
}
LAYER_TENSORS = {   # HF module -> llama.cpp tensor, written out here independently of gguf's TensorNameMap
    "input_layernorm": "attn_norm", "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm", "post_mlp_layernorm": "post_ffw_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def tiny_model(case: str):
    import transformers

    config = transformers.Glm4Config(**{**BASE_CONFIG, "head_dim": 16, **CASES[case]}, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Glm4ForCausalLM(config).float().eval()
    randomize_norms_and_biases(model, seed=0)
    return model


def write_gguf(path: Path, model, quantized: bool) -> dict[str, torch.Tensor]:
    """Writes the model as a GGUF; returns the float values the file holds, under HF names."""
    config = model.config
    writer = gguf.GGUFWriter(path, "glm4")
    add_common_hyperparameters(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    # pre-tokenizer "qwen2": the GGUF plugin's tokenizer knows no "glm4" yet
    add_tiny_tokenizer(writer, pre="qwen2")
    writer.add_pad_token_id(PAD_TOKEN_ID)
    stored = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue   # no output.weight: the embedding is the LM head
        array = value.detach().float().numpy()
        keep_float = not quantized or array.ndim < 2 or name.endswith("norm.weight")
        qtype = gguf.GGMLQuantizationType.F32 if keep_float else gguf.GGMLQuantizationType.Q8_0
        stored[name] = add_tensor(writer, hf_to_gguf_name(name, LAYER_TENSORS), array, qtype)
    write_file(writer)
    return stored


@dataclass(slots=True)
class GGUFCase:
    name: str
    quantized: bool
    path: Path
    model: Any    # the transformers model the file was written from
    oracle: Any   # the same model holding exactly the weights the file holds


@pytest.fixture(scope="module", params=[(c, q) for c in sorted(CASES) for q in (False, True)],
                ids=lambda p: f"{p[0]}-{'Q8_0' if p[1] else 'F32'}")
def case(request, tmp_path_factory) -> GGUFCase:
    name, quantized = request.param
    model = tiny_model(name)
    path = tmp_path_factory.mktemp(name) / f"tiny-glm4-{'Q8_0' if quantized else 'F32'}.gguf"
    stored = write_gguf(path, model, quantized)
    oracle = copy.deepcopy(model)
    if oracle.config.tie_word_embeddings:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    oracle.load_state_dict(stored)
    return GGUFCase(name, quantized, path, model, oracle.eval())


@pytest.fixture(scope="module")
def llm(case) -> LLM:
    return LLM(model=str(case.path), dtype="float32", num_kv_blocks=32)


def test_config_says_what_transformers_does(case: GGUFCase) -> None:
    ours, theirs = plugins.open_checkpoint(case.path).config, case.model.config
    assert ours.architectures == ["Glm4ForCausalLM"]
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "hidden_act", "attention_bias"]
    assert {f: ours.get(f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.rope_parameters == theirs.rope_parameters


def test_weights_load_as_the_file_holds_them(case: GGUFCase, llm: LLM) -> None:
    """Q8_0 linears keep their blocks, the fused gate_up_proj (ffn_up) among them."""
    model = llm.llm_engine.runner.model
    quantized = {name.rpartition(".")[2] for name, m in model.named_modules() if hasattr(m, "qweight")}
    assert quantized == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if case.quantized else set())


def test_prompt_logits_and_greedy_equal_transformers(case: GGUFCase, llm: LLM, harness) -> None:
    prompts = harness.prompts((6, 19, 37), seed=3)
    for prompt, logits in zip(prompts, llm.llm_engine.prompt_logits(prompts), strict=True):
        diff = (logits.float().cpu() - hf_logits(case.oracle, prompt)).abs().max().item()
        assert diff < harness.LOGITS_ATOL, f"prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"
    prompts = harness.prompts((5, 14, 27), seed=5)
    assert harness.greedy(llm, prompts) == harness.oracle_greedy(case.oracle, prompts)
