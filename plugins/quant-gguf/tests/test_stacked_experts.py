"""Stacked expert tensors (llama.cpp's 3-D ``ffn_*_exps``), one-row weights stored 1-D, and config values
read from tensor shapes: the GGUF plugin's side, with a test adapter (no model plugin needed)."""

from __future__ import annotations

import dataclasses
import logging

import gguf
import numpy as np
import pytest
import torch

from cvllm.gguf_adapter import GGUFArchitecture
from cvllm.registry import Registration, Registry
from cvllm_gguf import checkpoint as gguf_checkpoint
from cvllm_gguf.dequant import dequantize, dequantize_stacked
from cvllm_gguf.quant_types import GGMLType

EXPERTS, HIDDEN, MOE_INTER = 4, 64, 32
ADAPTER = GGUFArchitecture(
    hf_architecture="TinyMoeForCausalLM",
    hf_modules=("model.embed_tokens", "model.layers.{bid}.mlp.gate", "model.layers.{bid}.mlp.experts.gate_proj",
                "model.layers.{bid}.mlp.experts.up_proj", "model.layers.{bid}.mlp.experts.down_proj",
                "model.layers.{bid}.mlp.shared_expert_gate"),
    config_keys={"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                 "attention.head_count": "num_attention_heads", "expert_count": "num_experts"},
    config_from_tensor_shapes={"num_experts": ("blk.0.ffn_gate_exps.weight", 0),
                               "moe_intermediate_size": ("blk.0.ffn_gate_exps.weight", 1)},
    single_row_weights=("model.layers.{bid}.mlp.shared_expert_gate.weight",),
)


@pytest.mark.parametrize("qtype", [GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.F16])
def test_dequantize_stacked_equals_whole_dequantize(make_raw, qtype):
    shape = (3, 8, 256)  # [experts, out, in]
    blocks = make_raw(qtype, shape, np.random.default_rng(1))  # [experts, out, bytes_per_row]
    raw = torch.from_numpy(blocks).reshape(-1, blocks.shape[-1])  # rows back to back, as a file holds them
    whole = dequantize(raw, qtype, shape)
    assert torch.equal(dequantize_stacked(raw, qtype, shape, torch.float32), whole)
    bf16 = dequantize_stacked(raw, qtype, shape, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, whole.bfloat16())
    with pytest.raises(ValueError, match="needs"):
        dequantize_stacked(raw[:-1], qtype, shape, torch.bfloat16)


def write_moe_gguf(path, *, expert_count_key: bool):
    """Q8_0 stacked experts, an F32 router and a 1-D shared-expert gate; returns their float values."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "qwen2moe")
    writer.add_block_count(1)
    writer.add_embedding_length(HIDDEN)
    writer.add_head_count(4)
    writer.add_vocab_size(8)
    if expert_count_key:
        writer.add_expert_count(EXPERTS)
    values = {}
    tensors = {"token_embd.weight": ((8, HIDDEN), GGMLType.F32),
               "blk.0.ffn_gate_inp.weight": ((EXPERTS, HIDDEN), GGMLType.F32),
               "blk.0.ffn_gate_exps.weight": ((EXPERTS, MOE_INTER, HIDDEN), GGMLType.Q8_0),
               "blk.0.ffn_up_exps.weight": ((EXPERTS, MOE_INTER, HIDDEN), GGMLType.Q8_0),
               "blk.0.ffn_down_exps.weight": ((EXPERTS, HIDDEN, MOE_INTER), GGMLType.Q8_0),
               "blk.0.ffn_gate_inp_shexp.weight": ((HIDDEN,), GGMLType.F32)}
    for name, (shape, qtype) in tensors.items():
        data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), gguf.GGMLQuantizationType(qtype))
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(qtype))
        values[name] = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype))).float()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


@pytest.fixture
def registered(monkeypatch):
    registry = Registry("gguf_architecture", [Registration("test", "qwen2moe", ADAPTER)])
    monkeypatch.setattr(gguf_checkpoint.plugins, "gguf_architectures", lambda: registry)


@pytest.mark.parametrize("engine_dtype", [None, torch.float32, torch.bfloat16], ids=["unset", "exact", "bf16"])
def test_stacked_experts_load_dequantized_under_the_module_name(tmp_path, registered, caplog, engine_dtype):
    values = write_moe_gguf(tmp_path / "moe.gguf", expert_count_key=True)
    checkpoint = gguf_checkpoint.open_gguf_checkpoint(tmp_path / "moe.gguf")
    if engine_dtype is not None:  # what the engine does before it reads the weights
        gguf_checkpoint.gguf_linear_methods(checkpoint, engine_dtype)
    with caplog.at_level(logging.INFO, logger="cvllm_gguf.checkpoint"):
        weights = dict(checkpoint.weights())
    dtype = engine_dtype or torch.float32
    assert "moe.gguf: 3 stacked expert tensors (Q8_0) are dequantized to " \
           f"{str(dtype).removeprefix('torch.')} at load" in caplog.text
    for proj in ("gate", "up", "down"):
        got = weights[f"model.layers.0.mlp.experts.{proj}_proj"]  # no ".weight": FusedMoE's stacked form
        want = values[f"blk.0.ffn_{proj}_exps.weight"]
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    assert torch.equal(weights["model.layers.0.mlp.gate.weight"], values["blk.0.ffn_gate_inp.weight"])
    # the 1-D shared-expert gate is the one row of a [1, hidden] linear weight
    shared_gate = weights["model.layers.0.mlp.shared_expert_gate.weight"]
    assert shared_gate.shape == (1, HIDDEN) and torch.equal(shared_gate[0], values["blk.0.ffn_gate_inp_shexp.weight"])
    assert "model.layers.0.mlp.experts.gate_proj" not in checkpoint.quant_config.weight_types  # never a linear


def test_config_values_from_tensor_shapes_when_metadata_lacks_them(tmp_path, registered):
    write_moe_gguf(tmp_path / "moe.gguf", expert_count_key=False)
    config = gguf_checkpoint.open_gguf_checkpoint(tmp_path / "moe.gguf").config
    assert (config.num_experts, config.moe_intermediate_size) == (EXPERTS, MOE_INTER)


def test_metadata_wins_over_tensor_shapes(tmp_path, registered, monkeypatch):
    write_moe_gguf(tmp_path / "moe.gguf", expert_count_key=True)
    wrong = dataclasses.replace(ADAPTER, config_from_tensor_shapes={"num_experts": ("blk.0.ffn_gate_exps.weight", 1)})
    registry = Registry("gguf_architecture", [Registration("test", "qwen2moe", wrong)])
    monkeypatch.setattr(gguf_checkpoint.plugins, "gguf_architectures", lambda: registry)
    assert gguf_checkpoint.open_gguf_checkpoint(tmp_path / "moe.gguf").config.num_experts == EXPERTS
