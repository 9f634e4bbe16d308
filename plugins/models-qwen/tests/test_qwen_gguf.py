"""Qwen GGUF files (qwen2, qwen3, qwen2moe, qwen3moe) against transformers on the same tiny weights.

Each case builds a tiny random transformers model and writes it as llama.cpp's converter would
(names, metadata, stacked experts, a gpt2-style tokenizer with pre-tokenizer "qwen2"): once all
F32, once with Q8_0 linear and expert weights. cvllm's config derived from the GGUF must equal the
transformers config, and cvllm's float32 (exact path) prompt logits and greedy tokens must equal
transformers' on the same weights: the original ones for the F32 file, the Q8_0-rounded ones (gguf's
own quantize/dequantize) for the Q8_0 file.
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from cvllm import LLM, SamplingParams, plugins
from cvllm.testing import (
    CHATML_TEMPLATE,
    build_tiny_tokenizer,
    hf_greedy,
    hf_logits,
)
from cvllm.testing.checkpoints import (
    BASE_CONFIG,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    cvllm_greedy,
    randomize_norms_and_biases,
)
from cvllm_gguf.testing import (
    add_common_hyperparameters,
    add_tensor,
    add_tiny_tokenizer,
    hf_to_gguf_name,
    write_file,
)

NEW_TOKENS = 12
GREEDY_SEED = 5  # its prompts keep every oracle far from a near-tie, in every case
pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROPE_THETA = 1000000.0  # Qwen's base, not the 10000 a loader would fall back to
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# architecture -> (transformers class name, config overrides); each case sets something a loader could miss
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2", {}),  # q/k/v biases, not permuted
    "qwen3": ("Qwen3", {"head_dim": 32, "tie_word_embeddings": True}),  # head_dim != hidden / heads, tied
    "qwen2moe": ("Qwen2Moe", {**MOE, "shared_expert_intermediate_size": 96, "norm_topk_prob": False}),
    "qwen3moe": ("Qwen3Moe", {**MOE, "head_dim": 32, "norm_topk_prob": True}),
}
# HF module -> llama.cpp tensor, written out here independently of gguf's TensorNameMap
LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
}


def tiny_model(arch: str):
    import transformers

    prefix, overrides = CASES[arch]
    config = getattr(transformers, f"{prefix}Config")(
        **{**BASE_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA}, **overrides},
        attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()
    randomize_norms_and_biases(model, seed=0)  # HF starts them at 1 and 0: a loader that skipped them would pass
    return model


def converter_view(model) -> dict[str, torch.Tensor]:
    """The model's tensors as the converter names them (HF spelling): transformers 5 holds each layer's
    experts fused, gate_up_proj [experts, 2 * I, hidden] and down_proj; the converter splits gate from
    up and writes [experts, out, in] stacks under "...experts.gate_proj.weight" and the like."""
    out = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # no output.weight: the embedding is the LM head
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = value.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("mlp.experts.down_proj"):
            out[f"{name}.weight"] = value
        else:
            out[name] = value
    return out


def transformers_state(model, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``converter_view``'s inverse: a state dict for ``model`` from tensors in the converter's spelling."""
    state = {}
    for name in model.state_dict():
        if name.endswith("mlp.experts.gate_up_proj"):
            state[name] = torch.cat([values[name.replace("gate_up_proj", "gate_proj.weight")],
                                     values[name.replace("gate_up_proj", "up_proj.weight")]], dim=1)
        elif name.endswith("mlp.experts.down_proj"):
            state[name] = values[f"{name}.weight"]
        elif name == "lm_head.weight" and model.config.tie_word_embeddings:
            state[name] = values["model.embed_tokens.weight"]
        else:
            state[name] = values[name]
    return state


def stored_type(name: str, array: np.ndarray, quantized: bool) -> gguf.GGMLQuantizationType:
    """convert_hf_to_gguf's choice: 1-D tensors, norms and the router stay F32, the rest takes the file type."""
    if not quantized or array.ndim < 2 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name:
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType.Q8_0


@functools.cache
def tiny_tokenizer():
    return build_tiny_tokenizer()  # trained from a corpus: build it once


def add_tokenizer(writer: gguf.GGUFWriter) -> None:
    """The tiny byte-level BPE as llama.cpp's _set_vocab_gpt2 writes a Qwen vocabulary."""
    add_tiny_tokenizer(writer, pre="qwen2")
    writer.add_bos_token_id(PAD_TOKEN_ID)
    writer.add_pad_token_id(PAD_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)


def add_hyperparameters(writer: gguf.GGUFWriter, arch: str, config) -> None:
    add_common_hyperparameters(writer, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if "head_dim" in CASES[arch][1]:  # the converter writes head_dim when config.json has it
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if "moe" in arch:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def write_gguf(path, arch: str, model, quantized: bool) -> dict[str, torch.Tensor]:
    """Writes the model as a GGUF; returns the float values the file holds, in the converter's spelling."""
    writer = gguf.GGUFWriter(path, arch)
    add_hyperparameters(writer, arch, model.config)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    add_tokenizer(writer)
    stored = {}
    for name, value in converter_view(model).items():
        array = value.detach().float().numpy()
        if quantized and name.endswith("shared_expert_gate.weight"):
            array = array.reshape(-1)  # as older converters squeezed it: a 1-D [hidden] the loader must lift
        tensor = hf_to_gguf_name(name, LAYER_TENSORS)
        stored[name] = add_tensor(writer, tensor, array, stored_type(tensor, array, quantized)).view(value.shape)
    write_file(writer)
    return stored


@dataclass(slots=True)
class GGUFCase:
    arch: str
    quantized: bool
    path: Path
    oracle: Any  # the transformers model holding exactly the weights the file holds
    stored: dict[str, torch.Tensor]


@pytest.fixture(scope="module", params=sorted(CASES))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def hf_model(arch):
    return tiny_model(arch)


@pytest.fixture(scope="module", params=[False, True], ids=["F32", "Q8_0"])
def case(request, arch, hf_model, tmp_path_factory) -> GGUFCase:
    quantized = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}-{'Q8_0' if quantized else 'F32'}.gguf"
    stored = write_gguf(path, arch, hf_model, quantized)
    oracle = copy.deepcopy(hf_model)
    oracle.load_state_dict(transformers_state(oracle, stored))
    if not quantized:  # an F32 file holds the model itself
        assert all(torch.equal(a, b) for a, b in zip(oracle.state_dict().values(), hf_model.state_dict().values()))
    return GGUFCase(arch, quantized, path, oracle.eval(), stored)


@pytest.fixture(scope="module")
def fp32_llm(case) -> LLM:
    return LLM(model=str(case.path), dtype="float32", num_kv_blocks=32)


def config_fields(arch: str) -> list[str]:
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "hidden_act",
              "bos_token_id", "eos_token_id", "use_sliding_window"]
    if arch.startswith("qwen3"):
        fields.append("attention_bias")
    if "moe" in arch:
        fields += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                   "decoder_sparse_step", "mlp_only_layers"]
    if arch == "qwen2moe":
        fields += ["shared_expert_intermediate_size", "qkv_bias"]
    return fields


def test_config_equals_transformers(case: GGUFCase, hf_model) -> None:
    checkpoint = plugins.open_checkpoint(case.path)
    assert (checkpoint.format, checkpoint.quant_method) == ("gguf", "gguf")
    ours, theirs = checkpoint.config, hf_model.config
    assert ours.architectures == [type(hf_model).__name__]
    fields = config_fields(case.arch)
    want = {f: getattr(theirs, f, None) for f in fields}
    want["head_dim"] = want["head_dim"] or theirs.hidden_size // theirs.num_attention_heads  # Qwen2's implied one
    assert {f: ours.get(f) for f in fields} == want
    assert ours.rope_parameters == {"rope_type": "default", "rope_theta": ROPE_THETA}
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)  # GGUF stores a float32
    # the tokenizer rebuilt from the metadata: the tiny BPE's ids, ChatML template, <|im_end|> stops
    text = "The quick brown fox jumps over the lazy dog, and the cache keeps blocks."
    assert checkpoint.tokenizer.encode(text, add_special_tokens=False) == tiny_tokenizer().encode(text).ids
    assert checkpoint.tokenizer.chat_template == CHATML_TEMPLATE
    # <|im_end|> (eos) and <|endoftext|>, which llama.cpp always counts as an end-of-generation token
    assert checkpoint.eos_token_ids() == {EOS_TOKEN_ID, PAD_TOKEN_ID}


def fused_moe_layers(llm: LLM) -> list:
    return [m for m in llm.llm_engine.runner.model.modules() if hasattr(m, "w13_weight")]


def test_weights_load_as_the_file_holds_them(case: GGUFCase, fp32_llm: LLM) -> None:
    """Quantized linears keep Q8_0 blocks (exact fp32 path); stacked experts arrive dequantized, exactly."""
    model = fp32_llm.llm_engine.runner.model
    quantized = [m for m in model.modules() if hasattr(m, "qweight")]
    if case.quantized:
        assert quantized and all(m.qtype.name == "Q8_0" for m in quantized)
        assert all(m.quant_method.mode == "exact" and m.gguf_compute == "fp32" for m in quantized)
    else:
        assert not quantized
    experts = fused_moe_layers(fp32_llm)
    assert len(experts) == (BASE_CONFIG["num_hidden_layers"] if "moe" in case.arch else 0)
    for bid, layer in enumerate(experts):
        stem = f"model.layers.{bid}.mlp.experts"
        gate_up = torch.cat([case.stored[f"{stem}.gate_proj.weight"], case.stored[f"{stem}.up_proj.weight"]], 1)
        assert layer.w13_weight.dtype == torch.float32 and torch.equal(layer.w13_weight, gate_up)
        assert torch.equal(layer.w2_weight, case.stored[f"{stem}.down_proj.weight"])


def test_prompt_logits_equal_transformers(case: GGUFCase, fp32_llm: LLM, harness) -> None:
    prompts = harness.prompts((6, 19, 37), seed=3)
    for prompt, logits in zip(prompts, fp32_llm.llm_engine.prompt_logits(prompts), strict=True):
        want = hf_logits(case.oracle, prompt)
        diff = (logits.float().cpu() - want).abs().max().item()
        assert diff < harness.LOGITS_ATOL, f"{case.arch}: prompt of {len(prompt)} tokens: max |diff| {diff:.2e}"


def test_greedy_tokens_equal_transformers(case: GGUFCase, fp32_llm: LLM, harness) -> None:
    prompts = harness.prompts((5, 14, 27), seed=GREEDY_SEED)
    assert harness.greedy(fp32_llm, prompts, NEW_TOKENS) == harness.oracle_greedy(case.oracle, prompts, NEW_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_tokens_equal_transformers_on_cuda_with_graphs(case: GGUFCase, harness, monkeypatch) -> None:
    """The GGUF files (dense and MoE, F32 and Q8_0) on the CUDA backend with its defaults (graphs, async
    scheduling) but fp32 and float activations (the default int8 ones of up to 8 rows are llama.cpp's numerics,
    tested per kernel), greedy against transformers on the weights the file holds."""
    from cvllm_cuda.kernels import quant_gemv_int8
    monkeypatch.setenv(quant_gemv_int8.ENV, "0")
    prompts = harness.prompts((5, 14, 27), seed=GREEDY_SEED)
    want = hf_greedy(case.oracle, prompts, NEW_TOKENS)
    llm = LLM(model=str(case.path), backend="cuda", dtype="float32", max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [list(out.outputs[0].token_ids) for out in outputs] == want
    assert llm.llm_engine.runner.decode_forward.replays > 0, "no decode step replayed a CUDA graph"
    if case.quantized:   # Q8_0 experts computed from their low-bit planes, no float copy (cvllm_gguf/moe.py)
        assert all(layer.quant_method.planes is not None and layer.w13_weight.numel() == 0
                   for layer in fused_moe_layers(llm))


def test_bf16_engine_dequantizes_experts_to_bf16(tmp_path, caplog) -> None:
    """Quantized experts load as their blocks; without the CUDA kernels (here) each is then dequantized once to
    the engine's dtype: the file's numbers."""
    model = tiny_model("qwen3moe")
    path = tmp_path / "tiny-qwen3moe-Q8_0.gguf"
    stored = write_gguf(path, "qwen3moe", model, quantized=True)
    with caplog.at_level(logging.INFO, logger="cvllm_gguf.checkpoint"):
        llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=32)
    assert f"{path.name}: 6 stacked expert tensors (Q8_0) stay in their blocks" in caplog.text
    layer = fused_moe_layers(llm)[1]
    gate_up = torch.cat([stored["model.layers.1.mlp.experts.gate_proj.weight"],
                         stored["model.layers.1.mlp.experts.up_proj.weight"]], 1)
    assert layer.w13_weight.dtype == torch.bfloat16 and torch.equal(layer.w13_weight, gate_up.bfloat16())
    assert torch.equal(layer.w2_weight, stored["model.layers.1.mlp.experts.down_proj.weight"].bfloat16())


def test_quantized_experts_over_two_ranks(tmp_path, caplog, harness) -> None:
    """Two CPU ranks (gloo) on a Q8_0 Qwen3-MoE file: with expert parallelism each rank loads its whole experts'
    blocks; with tensor parallelism (experts split on the intermediate dimension) they are dequantized at load,
    said in the log. Both give one rank's greedy tokens."""
    path = tmp_path / "tiny-qwen3moe-Q8_0.gguf"
    write_gguf(path, "qwen3moe", tiny_model("qwen3moe"), quantized=True)
    prompts = harness.prompts((5, 14), seed=GREEDY_SEED)
    want = cvllm_greedy(path, prompts, 6, num_kv_blocks=32)
    assert cvllm_greedy(path, prompts, 6, num_kv_blocks=32, tensor_parallel_size=2, enable_expert_parallel=True) == want
    with caplog.at_level(logging.WARNING, logger="cvllm_gguf.checkpoint"):
        assert cvllm_greedy(path, prompts, 6, num_kv_blocks=32, tensor_parallel_size=2) == want
    assert caplog.text.count("are dequantized at load: tensor parallelism splits each expert") == 1   # not per layer
