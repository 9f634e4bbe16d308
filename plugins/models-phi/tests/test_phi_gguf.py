"""Phi GGUF files (phi2, phi3) against transformers on the same tiny weights.

Each case builds a tiny random transformers model and writes it as llama.cpp's converter would (names, metadata,
Phi-3's fused attn_qkv and gate+up ffn_up): once all F32, once with Q8_0 linear weights. cvllm's config from the
GGUF must say what the transformers config says, and its float32 prompt logits and greedy tokens must equal
transformers' on the weights the file holds (the Q8_0-rounded ones for the Q8_0 file). A LongRoPE phi3 file gives
transformers' config and logits too.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from cvllm import LLM, plugins
from cvllm.checkpoint.base import CheckpointError
from cvllm.testing import PAD_TOKEN_ID, hf_logits, randomize_norms_and_biases, tiny_config

gguf = pytest.importorskip("gguf")
gguf_plugin = pytest.importorskip("cvllm_gguf.plugin")
gguf_testing = pytest.importorskip("cvllm_gguf.testing")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# GGUF architecture -> (tiny architecture of conftest, config overrides); each sets something a loader could miss
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "phi2": ("phi", {}),                                                  # partial rotary 0.4, biases, LayerNorm
    "phi3": ("phi3", {"partial_rotary_factor": 0.75, "sliding_window": 8}),  # fused tensors, window, partial
}
LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.dense": "attn_output", "self_attn.o_proj": "attn_output",
    "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "model.final_layernorm": "output_norm", "lm_head": "output"}


@pytest.fixture(autouse=True)
def phi_plugin_only(monkeypatch: pytest.MonkeyPatch):
    """The Phi plugin and the GGUF plugin, nothing else installed."""
    from cvllm_phi import plugin

    monkeypatch.setenv("CVLLM_PLUGINS", "")
    plugins.reset_plugins()
    plugins.get_plugin_manager().register(plugin, name="phi")
    plugins.get_plugin_manager().register(gguf_plugin, name="gguf")
    yield
    plugins.reset_plugins()


def tiny_model(arch: str, **overrides: Any):
    import transformers

    tiny_arch, case_overrides = CASES[arch]
    config = tiny_config(tiny_arch, **{**case_overrides, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config).float().eval()
    randomize_norms_and_biases(model, seed=0)
    return model


def add_hyperparameters(writer, arch: str, config) -> None:
    """What convert_hf_to_gguf's Phi2Model / Phi3MiniModel write."""
    head_dim = config.hidden_size // config.num_attention_heads
    gguf_testing.add_common_hyperparameters(writer, config)
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    if arch == "phi2":
        writer.add_layer_norm_eps(config.layer_norm_eps)
        return
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_sliding_window(config.sliding_window)


def write_gguf(path, arch: str, model, quantized: bool, extra_tensors: dict[str, np.ndarray] | None = None,
               attn_factor: float | None = None) -> dict[str, torch.Tensor]:
    """Writes the model as a GGUF; returns the float values the file holds, by HF name."""
    writer = gguf.GGUFWriter(path, arch)
    add_hyperparameters(writer, arch, model.config)
    if attn_factor is not None:   # Phi3MiniModel's, with LongRoPE
        writer.add_rope_scaling_attn_factors(attn_factor)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    gguf_testing.add_tiny_tokenizer(writer)
    writer.add_bos_token_id(PAD_TOKEN_ID)
    writer.add_add_bos_token(False)
    stored = {}
    for name, value in model.state_dict().items():
        array = value.detach().float().numpy()
        quantize = quantized and array.ndim == 2 and "layernorm" not in name and "norm." not in name
        qtype = gguf.GGMLQuantizationType.Q8_0 if quantize else gguf.GGMLQuantizationType.F32
        tensor = gguf_testing.hf_to_gguf_name(name, LAYER_TENSORS, GLOBAL_TENSORS)
        stored[name] = gguf_testing.add_tensor(writer, tensor, array, qtype)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    gguf_testing.write_file(writer)
    return stored


@pytest.fixture(scope="module", params=[(a, q) for a in CASES for q in (False, True)],
                ids=[f"{a}-{'Q8_0' if q else 'F32'}" for a in CASES for q in (False, True)])
def case(request, tmp_path_factory):
    arch, quantized = request.param
    model = tiny_model(arch)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    stored = write_gguf(path, arch, model, quantized)
    oracle = copy.deepcopy(model)
    oracle.load_state_dict(stored)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    return arch, quantized, path, model.config, oracle.eval(), llm


def test_config_says_what_transformers_says(case) -> None:
    arch, _, path, theirs, _, _ = case
    ours = plugins.open_checkpoint(path).config
    assert ours.architectures == [{"phi2": "PhiForCausalLM", "phi3": "Phi3ForCausalLM"}[arch]]
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "tie_word_embeddings", "hidden_act"]
    fields += ["sliding_window", "original_max_position_embeddings"] if arch == "phi3" else []
    assert {f: ours.get(f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]
    head_dim = theirs.hidden_size // theirs.num_attention_heads
    assert int(head_dim * ours.rope_parameters["partial_rotary_factor"]) == \
        int(head_dim * theirs.rope_parameters["partial_rotary_factor"])


def test_weights_load_as_the_file_holds_them(case) -> None:
    arch, quantized, *_, llm = case
    layer = llm.llm_engine.runner.model.model.layers[0]
    kept = {name for name, m in layer.named_modules() if hasattr(m, "qweight")}
    if not quantized:
        assert not kept
    elif arch == "phi2":
        assert kept == {"self_attn.qkv_proj", "self_attn.dense", "mlp.fc1", "mlp.fc2"}
    else:  # the fused attn_qkv and ffn_up too: their rows of blocks are cut into the q/k/v and gate/up shards
        assert kept == {"self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"}


def test_prompt_logits_equal_transformers(case, harness) -> None:
    arch, _, _, _, oracle, llm = case
    prompts = harness.prompts((6, 19, 37), seed=3)
    for prompt, logits in zip(prompts, llm.llm_engine.prompt_logits(prompts), strict=True):
        diff = (logits.float().cpu() - hf_logits(oracle, prompt)).abs().max().item()
        assert diff < harness.LOGITS_ATOL, f"{arch}: prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"


def test_greedy_tokens_equal_transformers(case, harness) -> None:
    *_, oracle, llm = case
    prompts = harness.prompts((5, 14, 27), seed=6)   # no oracle near-tie in any case
    assert harness.greedy(llm, prompts, 12) == harness.oracle_greedy(oracle, prompts, 12)


def test_longrope_file_matches_transformers(tmp_path, harness) -> None:
    """LongRoPE as convert_hf_to_gguf writes it (rope_factors_long/short tensors, the original context and the
    attention factor as metadata) comes back as the Hugging Face config had it, and inside the original context
    (where transformers' per-sequence choice and cvllm's per-position one agree: test_phi3_longrope.py) the logits
    are transformers'."""
    half = int(16 * 0.75) // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 2.0 * i for i in range(half)]}
    model = tiny_model("phi3", original_max_position_embeddings=32, rope_parameters=rope)
    factors = {"rope_factors_long.weight": np.array(rope["long_factor"], np.float32),
               "rope_factors_short.weight": np.array(rope["short_factor"], np.float32)}
    path = tmp_path / "tiny-phi3-longrope.gguf"
    scale = model.config.max_position_embeddings / 32
    write_gguf(path, "phi3", model, quantized=False, extra_tensors=factors,
               attn_factor=float(np.sqrt(1 + np.log(scale) / np.log(32))))
    config = plugins.open_checkpoint(path).config
    params = config.rope_parameters
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == 32
    assert params["long_factor"] == pytest.approx(rope["long_factor"]) and \
        params["short_factor"] == pytest.approx(rope["short_factor"])
    llm = LLM(model=str(path), dtype="float32", max_num_seqs=4)
    prompts = harness.prompts((7, 19, 32), seed=31)
    for prompt, logits in zip(prompts, llm.llm_engine.prompt_logits(prompts), strict=True):
        diff = (logits.float().cpu() - hf_logits(model, prompt)).abs().max().item()
        assert diff < harness.LOGITS_ATOL, f"prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"


def test_longrope_file_with_one_factor_tensor_is_refused(tmp_path) -> None:
    model = tiny_model("phi3")
    path = tmp_path / "tiny-phi3-half-longrope.gguf"
    write_gguf(path, "phi3", model, quantized=False,
               extra_tensors={"rope_factors_long.weight": np.full(6, 2.0, np.float32)})
    with pytest.raises(CheckpointError, match="LongRoPE needs both"):
        plugins.open_checkpoint(path)
