"""config.json normalisation: both rope/dtype spellings, derived defaults, dtype names and errors."""

import json

import pytest
import torch

from cvllm.checkpoint.hf_dir import open_hf_checkpoint
from cvllm.config import ConfigError, load_json, model_config_from_dict, normalise_rope, resolve_dtype

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 128, "max_position_embeddings": 4096}
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
LLAMA3_EXPECTED = {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}


@pytest.mark.parametrize("raw", [
    pytest.param({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **LLAMA3_SCALING}}, id="published-type"),
    pytest.param({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}},
                 id="published-rope_type"),
    pytest.param({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_SCALING}},
                 id="transformers5"),
    pytest.param({"rope_parameters": {"full_attention": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                         **LLAMA3_SCALING}}}, id="transformers5-nested"),
    pytest.param({"rope_theta": 1.0, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                         **LLAMA3_SCALING}}, id="rope_parameters-wins"),
])
def test_rope_spellings_normalise_to_one_dict(raw):
    config = model_config_from_dict({**BASE, **raw})
    assert config.rope_parameters == LLAMA3_EXPECTED
    assert config.rope_theta == 500000.0


@pytest.mark.parametrize("raw, expected", [
    ({}, {"rope_type": "default", "rope_theta": 10000.0}),
    ({"rope_theta": 1e6}, {"rope_type": "default", "rope_theta": 1e6}),
    ({"rope_theta": 1e6, "rope_scaling": None}, {"rope_type": "default", "rope_theta": 1e6}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {"rope_type": "default", "rope_theta": 1e6}),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}},
     {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ({"rope_theta": 1e4, "rope_scaling": {"type": "su", "short_factor": [1.0]}},
     {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0]}),
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5},
     {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
      "partial_rotary_factor": 0.5},
     {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
])
def test_normalise_rope(raw, expected):
    assert normalise_rope(raw) == expected


def test_normalise_rope_does_not_modify_its_input():
    raw = {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    normalise_rope(raw)
    assert raw == {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}


@pytest.mark.parametrize("raw", [{"torch_dtype": "bfloat16"}, {"dtype": "bfloat16"}, {"dtype": "torch.bfloat16"},
                                 {"torch_dtype": "float16", "dtype": "bfloat16"}])
def test_dtype_spellings(raw):
    config = model_config_from_dict({**BASE, **raw})
    assert config.dtype == "bfloat16"
    assert config.get("torch_dtype") is None
    assert resolve_dtype("auto", config) is torch.bfloat16


def test_dtype_defaults_to_float32():
    assert model_config_from_dict(BASE).dtype == "float32"


def test_head_dim_default_and_explicit():
    assert model_config_from_dict(BASE).head_dim == 16
    assert model_config_from_dict({**BASE, "head_dim": 32}).head_dim == 32
    assert model_config_from_dict({**BASE, "head_dim": None}).head_dim == 16


@pytest.mark.parametrize("raw, expected", [
    ({}, 4), ({"num_key_value_heads": 2}, 2), ({"num_key_value_heads": None}, 4),
])
def test_num_key_value_heads_default(raw, expected):
    # transformers treats an explicit null like an absent key (multi-head attention)
    assert model_config_from_dict({**BASE, **raw}).num_key_value_heads == expected


def test_missing_attributes_raise_but_get_returns_default():
    config = model_config_from_dict(BASE)
    assert config.get("sliding_window") is None
    assert config.get("sliding_window", 7) == 7
    with pytest.raises(AttributeError):
        _ = config.sliding_window
    assert config.to_dict()["hidden_size"] == 64


@pytest.mark.parametrize("name, expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("float", torch.float32),
    ("float16", torch.float16), ("FP16", torch.float16), ("half", torch.float16),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), (torch.float16, torch.float16),
])
def test_resolve_dtype_names(name, expected):
    assert resolve_dtype(name, model_config_from_dict(BASE)) is expected


def test_resolve_dtype_auto_uses_the_checkpoint_dtype():
    assert resolve_dtype(None, model_config_from_dict({**BASE, "torch_dtype": "float16"})) is torch.float16
    assert resolve_dtype("auto", model_config_from_dict(BASE)) is torch.float32


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown dtype 'int8'; use auto, float32, float16 or bfloat16"):
        resolve_dtype("int8", model_config_from_dict(BASE))


@pytest.mark.parametrize("architectures", [None, []])
def test_missing_architectures_names_the_file(tmp_path, architectures):
    raw = {key: value for key, value in BASE.items() if key != "architectures"}
    if architectures is not None:
        raw["architectures"] = architectures
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        open_hf_checkpoint(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value)
    assert "architectures" in str(info.value)


def test_missing_required_key_is_named():
    raw = {key: value for key, value in BASE.items() if key != "vocab_size"}
    with pytest.raises(ConfigError, match="my/config.json: missing required key 'vocab_size'"):
        model_config_from_dict(raw, source="my/config.json")


def test_load_json_errors_name_the_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=f"{bad}: not valid JSON"):
        load_json(bad, "config.json")
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match=f"{bad}: expected a JSON object, got list"):
        load_json(bad, "config.json")
    with pytest.raises(ConfigError, match="config.json not found"):
        load_json(tmp_path / "absent.json", "config.json")


NEOX = {**BASE, "architectures": ["NeoXLikeForCausalLM"], "rotary_pct": 0.25, "rotary_emb_base": 20000}


def test_config_aliases_fill_the_fields_they_stand_for_and_the_file_stays_reachable():
    config = model_config_from_dict(NEOX, aliases={"rotary_pct": "partial_rotary_factor",
                                                   "rotary_emb_base": "rope_theta"})
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 20000, "partial_rotary_factor": 0.25}
    assert config.rope_theta == 20000
    assert config.raw_config == NEOX and "partial_rotary_factor" not in config.raw_config
    assert "raw_config" not in config.to_dict()
    # the config's own spelling wins over an alias
    both = model_config_from_dict({**NEOX, "rope_theta": 7.0}, aliases={"rotary_emb_base": "rope_theta"})
    assert both.rope_theta == 7.0
    assert model_config_from_dict(NEOX).rope_theta == 10000.0   # without aliases: the default


def test_a_registered_class_declares_its_config_aliases(tmp_path, add_plugin):
    from cvllm.hookspecs import hookimpl

    class NeoXLike:
        config_aliases = {"rotary_pct": "partial_rotary_factor", "rotary_emb_base": "rope_theta"}

    class Plugin:
        @hookimpl
        def register_architectures(self, register):
            register("NeoXLikeForCausalLM", NeoXLike)

    add_plugin(Plugin(), "neox-like")   # (registering clears the cached registries)
    (tmp_path / "config.json").write_text(json.dumps(NEOX))
    (tmp_path / "model.safetensors").write_bytes(b"")
    config = open_hf_checkpoint(tmp_path).config
    assert config.rope_parameters["partial_rotary_factor"] == 0.25 and config.rope_theta == 20000


def test_longrope_takes_the_top_level_original_context():
    """Phi-3's published configs keep original_max_position_embeddings top-level (transformers' longrope reads it
    there first); other rope types leave it alone."""
    scaling = {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}
    config = model_config_from_dict({**BASE, "original_max_position_embeddings": 4096, "rope_scaling": scaling})
    assert config.rope_parameters["rope_type"] == "longrope"
    assert config.rope_parameters["original_max_position_embeddings"] == 4096
    other = model_config_from_dict({**BASE, "original_max_position_embeddings": 4096})
    assert "original_max_position_embeddings" not in other.rope_parameters
