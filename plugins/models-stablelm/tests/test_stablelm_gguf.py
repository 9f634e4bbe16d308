"""StableLM GGUF files (stablelm) against transformers on the same tiny weights.

Each case builds a tiny random StableLmForCausalLM and writes it as llama.cpp's converter would (names, metadata
with rope.dimension_count = head_dim x partial_rotary_factor, per-head q/k norms stacked into attn_q_norm /
attn_k_norm, a gpt2-style tokenizer): once all F32, once with Q8_0 linear weights. The converter writes
use_parallel_residual True when config.json does not say; the files here always say True, so only the tensors
(llama.cpp's rule) can tell the sequential model. cvllm's config must say what transformers' does, and its float32
(exact path) prompt logits and greedy tokens must equal transformers' on the weights the file holds.
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
    "stablelm2": {"use_qkv_bias": True},                                   # sequential, biases
    "stablelm2_12b": {"qk_layernorm": True, "use_parallel_residual": True, "tie_word_embeddings": True},
}
LAYER_TENSORS = {   # HF module -> llama.cpp tensor, written out here independently of gguf's TensorNameMap
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def tiny_model(case: str):
    import transformers

    config = transformers.StableLmConfig(**{**BASE_CONFIG, **CASES[case]}, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.StableLmForCausalLM(config).float().eval()
    randomize_norms_and_biases(model, seed=0)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():   # the per-head norms too (randomize_norms_and_biases leaves norms.{h}.weight at 1)
        for name, param in model.named_parameters():
            if "layernorm.norms." in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
    return model


def converter_view(model) -> dict[str, torch.Tensor]:
    """The tensors as the converter names them: each layer's per-head q/k norms stacked [heads, head_dim]."""
    out: dict[str, list[torch.Tensor] | torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue   # no output.weight: the embedding is the LM head
        if ".norms." in name:
            out.setdefault(name.split(".norms.")[0] + ".weight", []).append(value)
        else:
            out[name] = value
    return {name: torch.stack(value) if isinstance(value, list) else value for name, value in out.items()}


def transformers_state(model, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {}
    for name in model.state_dict():
        if ".norms." in name:
            stem, _, rest = name.partition(".norms.")
            state[name] = values[f"{stem}.weight"][int(rest.split(".")[0])]
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            state[name] = values["model.embed_tokens.weight"]
        else:
            state[name] = values[name]
    return state


def write_gguf(path: Path, model, quantized: bool) -> dict[str, torch.Tensor]:
    """Writes the model as a GGUF; returns the float values the file holds, in the converter's spelling."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, "stablelm")
    add_common_hyperparameters(writer, config)
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_parallel_residual(True)
    writer.add_layer_norm_eps(config.layer_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    add_tiny_tokenizer(writer, pre="stablelm2")   # as llama.cpp writes StableLM-2's
    writer.add_pad_token_id(PAD_TOKEN_ID)
    stored = {}
    for name, value in converter_view(model).items():
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
    path = tmp_path_factory.mktemp(name) / f"tiny-stablelm-{'Q8_0' if quantized else 'F32'}.gguf"
    stored = write_gguf(path, model, quantized)
    oracle = copy.deepcopy(model)
    oracle.load_state_dict(transformers_state(oracle, stored))
    return GGUFCase(name, quantized, path, model, oracle.eval())


@pytest.fixture(scope="module")
def llm(case) -> LLM:
    return LLM(model=str(case.path), dtype="float32", num_kv_blocks=32)


def test_config_says_what_transformers_does(case: GGUFCase) -> None:
    ours, theirs = plugins.open_checkpoint(case.path).config, case.model.config
    assert ours.architectures == ["StableLmForCausalLM"]
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "tie_word_embeddings", "hidden_act", "use_qkv_bias", "qk_layernorm",
              "use_parallel_residual"]
    assert {f: ours.get(f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.rope_parameters == theirs.rope_parameters
    assert ours.layer_norm_eps == pytest.approx(theirs.layer_norm_eps, rel=1e-6)   # GGUF stores a float32


def test_weights_load_as_the_file_holds_them(case: GGUFCase, llm: LLM) -> None:
    model = llm.llm_engine.runner.model
    quantized = {name.rpartition(".")[2] for name, m in model.named_modules() if hasattr(m, "qweight")}
    assert quantized == ({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if case.quantized else set())
    if model.config.qk_layernorm:   # the stacked norms split back into one weight a head
        ours = model.model.layers[1].self_attn.k_layernorm.stacked_weight
        theirs = torch.stack([norm.weight for norm in case.oracle.model.layers[1].self_attn.k_layernorm.norms])
        assert torch.equal(ours, theirs)


def test_prompt_logits_and_greedy_equal_transformers(case: GGUFCase, llm: LLM, harness) -> None:
    prompts = harness.prompts((6, 19, 37), seed=3)
    for prompt, logits in zip(prompts, llm.llm_engine.prompt_logits(prompts), strict=True):
        diff = (logits.float().cpu() - hf_logits(case.oracle, prompt)).abs().max().item()
        assert diff < harness.LOGITS_ATOL, f"prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"
    prompts = harness.prompts((5, 14, 27), seed=5)
    assert harness.greedy(llm, prompts) == harness.oracle_greedy(case.oracle, prompts)
