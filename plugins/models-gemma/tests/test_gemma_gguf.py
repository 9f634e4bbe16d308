"""Gemma GGUF files (gemma, gemma2, gemma3) against transformers on the same tiny weights.

Each case builds a tiny random transformers model and writes it as llama.cpp's converter does (names, metadata,
every norm weight with Gemma's 1 added, no output.weight), all F32. cvllm's config derived from the GGUF must
equal the transformers config, and cvllm's float32 prompt logits and greedy tokens must equal transformers'.
The tiny byte-level BPE stands in for Gemma's SentencePiece vocabulary: the prompts are token ids.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from cvllm import LLM, plugins
from cvllm.testing import PAD_TOKEN_ID, hf_logits, randomize_norms_and_biases, tiny_config
from cvllm_gemma.gguf_adapter import query_scale_as_llama_cpp
from cvllm_gemma.layers import GemmaRMSNorm

gguf = pytest.importorskip("gguf")
# the GGUF plugin opens .gguf files (this one only declares the family); its testing module writes them
gguf_testing = pytest.importorskip("cvllm_gguf.testing")

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NEW_TOKENS = 12
# global layers with linear rope scaling (the 4B-27B models'), local ones at llama.cpp's fixed base
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# arch -> (transformers model class, config overrides). query_pre_attn_scalar = head_dim, the scale llama.cpp
# uses outside the 27B models; Gemma 3 with llama.cpp's fixed pattern, one global layer in 6
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma": ("GemmaForCausalLM", {"num_key_value_heads": 1}),
    "gemma2": ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3ForCausalLM", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                                     "sliding_window_pattern": 6, "rope_parameters": GEMMA3_ROPE}),
}
# HF module -> llama.cpp tensor, written out here independently of gguf's TensorNameMap
LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}
POST_ATTENTION_NORM = {"gemma": "ffn_norm", "gemma2": "post_attention_norm", "gemma3": "post_attention_norm"}
GLOBAL_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}


def gguf_name(arch: str, name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[module]}.{suffix}"
    _, _, block, rest = module.split(".", 3)
    tensor = POST_ATTENTION_NORM[arch] if rest == "post_attention_layernorm" else LAYER_TENSORS[rest]
    return f"blk.{block}.{tensor}.{suffix}"


def add_hyperparameters(writer, arch: str, config) -> None:
    """What Gemma{,2,3}Model.set_gguf_parameters write."""
    gguf_testing.add_common_hyperparameters(writer, config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        full = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])


def write_gguf(path: Path, arch: str, model) -> None:
    writer = gguf.GGUFWriter(path, arch)
    add_hyperparameters(writer, arch, model.config)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    gguf_testing.add_tiny_tokenizer(writer)
    writer.add_bos_token_id(PAD_TOKEN_ID)
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue   # tied: the converter skips it
        array = value.detach().float()
        if name.endswith("norm.weight"):
            array = array + 1   # as the converter: the norm's whole scale
        writer.add_tensor(gguf_name(arch, name), array.numpy())
    gguf_testing.write_file(writer)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory) -> tuple[str, Path, Any]:
    import transformers

    arch = request.param
    model_class, overrides = CASES[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(tiny_config(arch, **overrides)).float().eval()
    randomize_norms_and_biases(model, seed=0)
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}-F32.gguf"
    write_gguf(path, arch, model)
    return arch, path, model


@pytest.fixture(scope="module")
def fp32_llm(case) -> LLM:
    return LLM(model=str(case[1]), dtype="float32", num_kv_blocks=32)


def test_config_equals_transformers(case) -> None:
    arch, path, model = case
    ours, theirs = plugins.open_checkpoint(path).config, model.config
    assert ours.architectures == [CASES[arch][0]]
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings"]
    if arch != "gemma":
        fields += ["query_pre_attn_scalar", "sliding_window", "attn_logit_softcapping", "final_logit_softcapping"]
    assert {f: ours.get(f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # GGUF stores a float32


def test_model_as_transformers_builds_it(case, fp32_llm) -> None:
    arch, _, model = case
    ours = fp32_llm.llm_engine.runner.model
    theirs = dict(model.named_parameters())
    for name, module in ours.named_modules():   # the norms hold w again, not the file's 1 + w (rounded in fp32)
        if isinstance(module, GemmaRMSNorm):
            assert torch.equal(module.weight, (theirs[f"{name}.weight"].detach() + 1) - 1), name
    if arch != "gemma":
        windows = [layer.self_attn.attn.sliding_window for layer in ours.model.layers]
        assert windows == [model.config.sliding_window if t == "sliding_attention" else None
                           for t in model.config.layer_types]


def test_prompt_logits_equal_transformers(case, fp32_llm, harness) -> None:
    prompts = [[3 + (i * 37 + n) % 500 for i in range(n)] for n in (6, 19, 37)]
    for prompt, logits in zip(prompts, fp32_llm.llm_engine.prompt_logits(prompts), strict=True):
        diff = (logits.float().cpu() - hf_logits(case[2], prompt)).abs().max().item()
        assert diff < harness.LOGITS_ATOL, f"{case[0]}: prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"


def test_greedy_tokens_equal_transformers(case, fp32_llm, harness) -> None:
    prompts = harness.prompts((5, 14, 27), seed=5)
    assert harness.greedy(fp32_llm, prompts, NEW_TOKENS) == harness.oracle_greedy(case[2], prompts, NEW_TOKENS)


@functools.cache
def _published() -> dict[str, tuple[dict[str, Any], int]]:
    """The published configs' shapes (GGUF key values) and their query_pre_attn_scalar."""
    def shape(model_type: str, hidden: int, heads: int, head_dim: int, layers: int) -> dict[str, Any]:
        return {"model_type": model_type, "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim,
                "num_hidden_layers": layers}

    return {"gemma-2-2b": (shape("gemma2", 2304, 8, 256, 26), 256),
            "gemma-2-9b": (shape("gemma2", 3584, 16, 256, 42), 256),
            "gemma-2-27b": (shape("gemma2", 4608, 32, 128, 46), 144),
            "gemma-3-12b": (shape("gemma3", 3840, 16, 256, 48), 256),
            "gemma-3-27b": (shape("gemma3", 5376, 32, 128, 62), 168)}


@pytest.mark.parametrize("name", ["gemma-2-2b", "gemma-2-9b", "gemma-2-27b", "gemma-3-12b", "gemma-3-27b"])
def test_query_scale_as_the_published_configs(name: str) -> None:
    raw, published = _published()[name]
    assert query_scale_as_llama_cpp(dict(raw), None, {})["query_pre_attn_scalar"] == published
