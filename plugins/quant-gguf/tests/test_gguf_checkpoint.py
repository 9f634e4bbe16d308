"""A tiny llama written the way llama.cpp's converter writes it, loaded through the plugin hooks.

The oracle is an independent picture of the same model: the test keeps each tensor's blocks in
Hugging Face row order, writes them to the GGUF under llama.cpp's names (q/k rows permuted with
convert_hf_to_gguf's ``LlamaModel.permute``), and writes their float values (the gguf package's
dequantizer) into a Hugging Face directory. Loaded in float32, the two checkpoints must hold
bit-equal weights and generate the same tokens with the same log-probabilities.
"""

from __future__ import annotations

import logging
import re

import gguf
import numpy as np
import pytest
import torch

from cvllm import LLM, plugins
from cvllm.checkpoint.base import CheckpointError
from cvllm.layers.rotary import _base_inv_freq, _llama3_inv_freq
from cvllm.sampling_params import SamplingParams
from cvllm_gguf.quant_types import GGMLType
from cvllm_gguf.testing import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, LAYERS, VOCAB, write_tiny_llama


def effective_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """What each module multiplies by: parameters and the exact path's dequantized ``weight`` buffers."""
    model = llm.llm_engine.runner.model
    out = {name: t for name, t in model.named_parameters() if not name.endswith("qweight")}
    out.update({name: t for name, t in model.named_buffers() if name.endswith(".weight")})
    return out


def generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


PROMPTS = [[5, 17, 33, 2], [90, 1, 44, 44, 3, 8, 61, 12, 70, 9, 11, 4, 85, 30, 31, 32, 33, 50], [7]]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_loads_like_the_same_weights_in_a_hf_directory(tmp_path, make_rows, tied):
    path, hf_dir, raw_rows = write_tiny_llama(tmp_path, make_rows, tied=tied)
    checkpoint = plugins.open_checkpoint(path)
    assert checkpoint.format == "gguf" and checkpoint.quant_method == "gguf"
    cfg = checkpoint.config
    assert (cfg.architectures, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == \
        (["LlamaForCausalLM"], HIDDEN, INTER, LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == \
        (HEADS, KV_HEADS, HEAD_DIM, VOCAB)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg.tie_word_embeddings is tied and cfg.max_position_embeddings == 256
    assert checkpoint.tokenizer is None  # a weights-only file

    ours = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    reference = LLM(model=str(hf_dir), dtype="float32", num_kv_blocks=32)
    model = ours.llm_engine.runner.model
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert (qkv.qtype, qkv.gguf_compute, qkv.quant_method.mode) == (GGMLType.Q4_1, "fp32", "exact")
    # the un-permuted q/k rows are the HF-order bytes, exactly
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    assert torch.equal(qkv.qweight[:q_rows], raw_rows["model.layers.1.self_attn.q_proj"])
    assert torch.equal(qkv.qweight[q_rows:q_rows + kv_rows], raw_rows["model.layers.1.self_attn.k_proj"])
    assert model.model.layers[0].mlp.down_proj.qtype == GGMLType.Q4_K
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied

    ours_weights, reference_weights = effective_weights(ours), effective_weights(reference)
    assert sorted(ours_weights) == sorted(reference_weights)
    for name, value in reference_weights.items():
        assert torch.equal(ours_weights[name], value), name

    for mine, theirs in zip(generate(ours, PROMPTS), generate(reference, PROMPTS)):
        assert mine.token_ids == theirs.token_ids
        got = [entry[t].logprob for entry, t in zip(mine.logprobs, mine.token_ids)]
        want = [entry[t].logprob for entry, t in zip(theirs.logprobs, theirs.token_ids)]
        assert got == pytest.approx(want, abs=1e-5)


def test_bf16_engine_uses_the_fast_path(tmp_path, make_rows):
    path, hf_dir, _ = write_tiny_llama(tmp_path, make_rows)
    llm = LLM(model=str(path), dtype="bfloat16", num_kv_blocks=32)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert (layer.self_attn.qkv_proj.gguf_compute, layer.self_attn.qkv_proj.quant_method.mode) == ("int4pack", "fast")
    assert layer.mlp.gate_up_proj.gguf_compute == "bf16"
    assert llm.llm_engine.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    reference = LLM(model=str(hf_dir), dtype="float32", num_kv_blocks=32)
    mine, theirs = generate(llm, PROMPTS[:1]), generate(reference, PROMPTS[:1])
    assert mine[0].token_ids[:3] == theirs[0].token_ids[:3]


def test_float_linears_stay_unquantized(tmp_path, make_rows):
    path, hf_dir, _ = write_tiny_llama(tmp_path, make_rows, float_linears=("gate_proj", "up_proj"))
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    mlp = llm.llm_engine.runner.model.model.layers[0].mlp
    assert not hasattr(mlp.gate_up_proj, "qweight") and hasattr(mlp.down_proj, "qweight")
    reference = effective_weights(LLM(model=str(hf_dir), dtype="float32", num_kv_blocks=32))
    for name, value in effective_weights(llm).items():
        assert torch.equal(value, reference[name]), name


def test_fused_layer_of_mixed_types_keeps_each_parts_blocks(tmp_path, make_rows, caplog):
    """llama.cpp's *_M mixes: a Q8_0 v_proj beside Q4_1 q/k fuse into one layer that keeps each part's blocks."""
    path, hf_dir, _ = write_tiny_llama(tmp_path, make_rows, types={"v_proj": GGMLType.Q8_0,
                                                                   "up_proj": GGMLType.Q4_0})
    with caplog.at_level(logging.WARNING, logger="cvllm_gguf.checkpoint"):
        llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    assert "different GGML types" not in caplog.text
    layer = llm.llm_engine.runner.model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert type(qkv.quant_method).__name__ == type(gate_up.quant_method).__name__ == "MixedGGUFLinearMethod"
    assert [part[1] for part in qkv.gguf_parts] == [GGMLType.Q4_1, GGMLType.Q4_1, GGMLType.Q8_0]
    reference = effective_weights(LLM(model=str(hf_dir), dtype="float32", num_kv_blocks=32))
    for name, value in effective_weights(llm).items():
        assert torch.equal(value, reference[name]), name
    two = LLM(model=str(path), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in generate(two, PROMPTS)] == [o.token_ids for o in generate(llm, PROMPTS)]
    finally:
        two.shutdown()


def test_rope_scaling_from_metadata(tmp_path, make_rows):
    path, _, _ = write_tiny_llama(tmp_path, make_rows, extra={
        "type": lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
        "factor": lambda w: w.add_rope_scaling_factor(4.0)})
    assert plugins.open_checkpoint(path).config.rope_parameters == \
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def test_llama3_rope_rebuilt_from_rope_freqs(tmp_path, make_rows):
    """llama.cpp keeps Llama 3.1's rope scaling only as per-dimension factors: inv_freq / llama3 inv_freq."""
    params = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    factors = (_base_inv_freq(10000.0, HEAD_DIM) / _llama3_inv_freq(params, HEAD_DIM)).numpy()
    assert factors.min() == pytest.approx(1) and factors.max() == pytest.approx(8) and len(set(factors)) > 2
    def add_factors(writer: gguf.GGUFWriter) -> None:
        writer.add_tensor("rope_freqs.weight", factors)

    path, _, _ = write_tiny_llama(tmp_path, make_rows, extra={"rope_freqs": add_factors})
    assert plugins.open_checkpoint(path).config.rope_parameters == pytest.approx(params)

    factors[1] *= 1.5  # not llama3's curve
    other = tmp_path / "other"
    other.mkdir()
    path, _, _ = write_tiny_llama(other, make_rows, extra={"rope_freqs": add_factors})
    with pytest.raises(CheckpointError, match="rope_freqs tensor is not a llama3 rope scaling"):
        plugins.open_checkpoint(path)


def test_split_set_loads_like_one_file(tmp_path, make_rows):
    path, _, _ = write_tiny_llama(tmp_path, make_rows)
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(tmp_path / "split.gguf", "llama", split_max_tensors=7)
    for field in reader.fields.values():
        if not field.name.startswith(("GGUF.", "general.architecture")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(parts) == 3  # 21 tensors, 7 per file
    whole, split = plugins.open_checkpoint(path), plugins.open_checkpoint(parts[0])
    assert whole.config == split.config
    pairs = list(zip(whole.weights(), split.weights(), strict=True))
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in pairs)


def test_unknown_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    declared = ", ".join(plugins.gguf_architectures().names())  # llama, and whatever other model plugins add
    assert "llama" in declared.split(", ")
    with pytest.raises(CheckpointError, match=re.escape(f"GGUF architecture 'gpt2' is not declared by any installed "
                                                        f"model plugin (declared: {declared})")):
        plugins.open_checkpoint(path)


LLAMA_CPP_DEFAULTS = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)


def test_sampling_defaults_without_metadata_are_llama_cpp_s(tmp_path, make_rows):
    """A GGUF has no generation_config.json: llama.cpp's server defaults stand in, not temperature 1."""
    path, _, _ = write_tiny_llama(tmp_path, make_rows)
    assert LLM(model=str(path), dtype="float32").default_sampling_params() == LLAMA_CPP_DEFAULTS
    assert LLM(model=str(path), dtype="float32", generation_config="vllm").default_sampling_params() == \
        SamplingParams()


def test_sampling_metadata_overrides_llama_cpp_s_defaults(tmp_path, make_rows, caplog):
    # written with gguf-py's own writers, so the key names are llama.cpp's
    path, _, _ = write_tiny_llama(tmp_path, make_rows, extra={
        "temp": lambda w: w.add_sampling_temp(0.5), "top_k": lambda w: w.add_sampling_top_k(20),
        "penalty": lambda w: w.add_sampling_penalty_repeat(1.25),
        "top_p": lambda w: w.add_sampling_top_p(0.0)})  # SamplingParams refuses it: llama.cpp's stays
    with caplog.at_level(logging.WARNING, logger="cvllm_gguf.checkpoint"):
        generation_config = plugins.open_checkpoint(path).generation_config
    assert generation_config == {"temperature": 0.5, "top_k": 20, "top_p": 0.95, "min_p": 0.05,
                                 "repetition_penalty": 1.25}
    assert "ignoring general.sampling.top_p = 0.0: top_p must be in (0, 1]" in caplog.text


def test_cvserve_generation_config_flag(tmp_path, make_rows):
    """Weakest first: the model's defaults (unless --generation-config vllm), cvserve's flags, the request."""
    from cvllm.server.cli import build_server_args
    from cvllm.server.state import ServerState

    path, _, _ = write_tiny_llama(tmp_path, make_rows)
    generation_config = plugins.open_checkpoint(path).generation_config

    def sampling_defaults(*flags: str) -> dict:
        args = build_server_args(["--w", str(path), *flags])
        return ServerState(args, None, str(path), ["tiny"], None, generation_config).sampling_defaults

    assert build_server_args(["--w", str(path)]).generation_config == "auto"
    assert sampling_defaults() == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert sampling_defaults("--top-k", "5") == {"temperature": 0.8, "top_k": 5, "top_p": 0.95, "min_p": 0.05}
    assert sampling_defaults("--generation-config", "vllm") == {}
    assert sampling_defaults("--generation-config", "vllm", "--top-k", "5") == {"top_k": 5}
    with pytest.raises(SystemExit):
        build_server_args(["--w", str(path), "--generation-config", "model"])
