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
