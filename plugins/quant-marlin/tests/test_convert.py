"""``cvllm convert SRC OUT --to gptq``: the written GPTQ checkpoint loads through the GPTQ path and computes what
``--isq gptq`` computes on the source (the same round-to-nearest), bit for bit in float32; options and bad input."""

from __future__ import annotations

import json

import pytest
from test_isq import run

from cvllm.cli import main
from cvllm.testing.checkpoints import make_checkpoint


@pytest.fixture
def base(tmp_path):
    # every projection's inputs whole groups of 128, the default of both --isq gptq and the converter
    make_checkpoint(tmp_path / "base", "llama", shards=2, hidden_size=128, intermediate_size=256)
    return tmp_path / "base"


def test_converted_checkpoint_equals_isq_gptq(tmp_path, base, capsys):
    out = tmp_path / "gptq"
    assert main(["convert", str(base), str(out), "--to", "gptq"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                             "desc_act": False, "checkpoint_format": "gptq"}
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.q_proj.qweight" in index["weight_map"]
    assert "model.layers.0.self_attn.q_proj.weight" not in index["weight_map"]
    converted, kinds = run(out)
    assert kinds == {"GPTQLinearMethod"}
    in_situ, _ = run(base, isq="gptq")
    assert converted == in_situ


def test_eight_bit_asymmetric_loads(tmp_path, base):
    out = tmp_path / "gptq8"
    assert main(["convert", str(base), str(out), "--to", "gptq", "--bits", "8", "--group-size", "32", "--asym"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["sym"] is False
    tokens, kinds = run(out)
    assert kinds == {"GPTQLinearMethod"} and len(tokens) == 2


def test_bad_input_is_refused(tmp_path, base, capsys):
    assert main(["convert", str(base), str(tmp_path / "x"), "--to", "nope"]) == 2
    assert "no converter 'nope'" in capsys.readouterr().err
    assert main(["convert", str(tmp_path), str(tmp_path / "x"), "--to", "gptq"]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err
    assert main(["convert", str(base), str(tmp_path / "x"), "--to", "gptq", "--bits", "3"]) == 1
    assert "4 or 8 bits" in capsys.readouterr().err
    assert main(["convert", str(base), str(base), "--to", "gptq"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_moe_experts_are_converted_and_the_copy_loads(tmp_path):
    make_checkpoint(tmp_path / "moe", "qwen3_moe")
    out = tmp_path / "moe-gptq"
    assert main(["convert", str(tmp_path / "moe"), str(out), "--to", "gptq", "--group-size", "32"]) == 0
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        names = list(f.keys())
    assert any(".experts." in n and n.endswith(".qweight") for n in names)
    assert not any(".experts." in n and n.endswith(".weight") for n in names)
    assert any(n.endswith("mlp.gate.weight") for n in names)   # the router stays float
    assert any(n.endswith("self_attn.q_proj.qweight") for n in names)
    from cvllm.testing.checkpoints import cvllm_greedy

    assert len(cvllm_greedy(out, [[1, 2, 3]], 4, dtype="float32", num_kv_blocks=32)[0]) == 4


def split_in_two(directory):
    """``directory``'s model.safetensors as two shards with an index, each layer's qweight in one shard and its
    qzeros and scales in the other (a converter must find a layer's parts wherever they are)."""
    from safetensors.torch import load_file, save_file
    state = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    first = {k: v for k, v in state.items() if not k.endswith((".qzeros", ".scales"))}
    second = {k: v for k, v in state.items() if k not in first}
    save_file(first, directory / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, directory / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    weight_map = {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(second, "model-00002-of-00002.safetensors")}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("group_size", [32, -1])
def test_an_awq_checkpoint_is_repacked_and_computes_the_same(tmp_path, group_size):
    """AWQ -> GPTQ (candle-vllm's convert_awq_marlin.py job): the same integers, zeros and scales in GPTQ's layout,
    asymmetric, so the copy's greedy tokens and logprobs equal the AWQ checkpoint's (float32), with a layer's parts
    in different shards."""
    from marlin_reference import write_quantized
    make_checkpoint(tmp_path / "base", "llama")
    awq = tmp_path / "awq"
    write_quantized(tmp_path / "base", awq, "awq", group_size=group_size)
    split_in_two(awq)
    out = tmp_path / "gptq"
    assert main(["convert", str(awq), str(out), "--to", "gptq"]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": False, "desc_act": False,
        "checkpoint_format": "gptq"}
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    layer = "model.layers.0.self_attn.q_proj"
    assert {weight_map[f"{layer}.{part}"] for part in ("qweight", "qzeros", "scales", "g_idx")} == \
        {"model-00001-of-00002.safetensors"}
    repacked, kinds = run(out)
    assert kinds == {"GPTQLinearMethod"}
    original, original_kinds = run(awq)
    assert original_kinds == {"AWQLinearMethod"} and repacked == original


def test_an_awq_checkpoint_keeps_its_own_settings(tmp_path, capsys):
    from marlin_reference import write_quantized
    make_checkpoint(tmp_path / "base", "llama")
    write_quantized(tmp_path / "base", tmp_path / "awq", "awq", group_size=32)
    for flags, message in ((["--bits", "8"], "--bits 8: an AWQ checkpoint is repacked"),
                           (["--group-size", "64"], "its group_size 32 is kept"),
                           (["--sym"], "asymmetric")):
        assert main(["convert", str(tmp_path / "awq"), str(tmp_path / "x"), "--to", "gptq", *flags]) == 1
        assert message in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "awq"), str(tmp_path / "y"), "--to", "gptq", "--asym", "--bits", "4",
                 "--group-size", "32"]) == 0
