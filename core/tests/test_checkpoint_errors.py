"""Broken checkpoints fail with messages that name the file, parameter or architecture at fault."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import cvllm
from cvllm import plugins
from cvllm.checkpoint.base import CheckpointError
from cvllm.checkpoint.hf_dir import open_hf_checkpoint
from cvllm.checkpoint.safetensors_files import iterate_safetensors
from cvllm.plugins import RegistryError

HIDDEN, INTER, HEADS, VOCAB = 32, 64, 2, 64
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": INTER,
    "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "num_hidden_layers": 1, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
    "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True)
def installed_plugins(monkeypatch):
    # Every installed plugin (the editable cvllm-llama included), whatever another test left behind.
    monkeypatch.delenv("CVLLM_PLUGINS", raising=False)
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def llama_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    layer = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        layer + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        layer + "self_attn.k_proj.weight": (HIDDEN, HIDDEN),
        layer + "self_attn.v_proj.weight": (HIDDEN, HIDDEN),
        layer + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        layer + "mlp.gate_proj.weight": (INTER, HIDDEN),
        layer + "mlp.up_proj.weight": (INTER, HIDDEN),
        layer + "mlp.down_proj.weight": (HIDDEN, INTER),
        layer + "input_layernorm.weight": (HIDDEN,),
        layer + "post_attention_layernorm.weight": (HIDDEN,),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    return {name: torch.randn(*shape, generator=gen) * 0.1 for name, shape in shapes.items()}


def write_checkpoint(dir: Path, weights: dict[str, torch.Tensor] | None = None, **config) -> Path:
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "config.json").write_text(json.dumps({**CONFIG, **config}))
    save_file(llama_weights() if weights is None else weights, str(dir / "model.safetensors"))
    return dir


def read_all(dir: Path) -> list[str]:
    return [name for name, _ in open_hf_checkpoint(dir).weights()]


def test_the_tiny_checkpoint_itself_loads(tmp_path):
    # The error tests below change one thing each from this working baseline.
    llm = cvllm.LLM(model=str(write_checkpoint(tmp_path / "ok")), dtype="float32", num_kv_blocks=8)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, cvllm.SamplingParams(max_tokens=2, temperature=0.0,
                                                                             ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2


def test_missing_config_json(tmp_path):
    save_file(llama_weights(), str(tmp_path / "model.safetensors"))
    for open_ in (open_hf_checkpoint, plugins.open_checkpoint):
        with pytest.raises(CheckpointError) as info:
            open_(tmp_path)
        assert str(tmp_path) in str(info.value) and "config.json" in str(info.value)


def test_no_weight_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "training_args.bin").write_bytes(b"")   # not a weight file
    with pytest.raises(CheckpointError, match=r"no weight files \(\*\.safetensors, or pytorch_model\*\.bin\)"):
        open_hf_checkpoint(tmp_path)


def test_bad_pytorch_bin_files_are_named(tmp_path):
    """A truncated .bin and one whose pickle would run code (refused by weights_only) each name the file."""
    import pickle

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    weights = tmp_path / "pytorch_model.bin"
    weights.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: truncated or not a PyTorch weights file"):
        list(open_hf_checkpoint(tmp_path).weight_iterator())

    class RunsCode:
        def __reduce__(self):
            return (print, ("unpickled",))

    with open(weights, "wb") as f:
        pickle.dump({"x": RunsCode()}, f, protocol=2)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: refused: not plain tensors"):
        list(open_hf_checkpoint(tmp_path).weight_iterator())


def test_unknown_architecture_lists_the_registered_ones(tmp_path):
    with pytest.raises(RegistryError) as info:
        plugins.architectures().get("NoSuchForCausalLM")
    message = str(info.value)
    assert "'NoSuchForCausalLM'" in message and "LlamaForCausalLM" in message

    model = write_checkpoint(tmp_path, architectures=["NoSuchForCausalLM"])
    with pytest.raises(RegistryError) as info:
        cvllm.LLM(model=str(model), dtype="float32")
    message = str(info.value)
    assert "'NoSuchForCausalLM'" in message
    assert "registered:" in message and "LlamaForCausalLM" in message


def test_truncated_data_section(tmp_path):
    model = write_checkpoint(tmp_path)
    weights_file = model / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as info:
        read_all(model)
    message = str(info.value)
    assert str(weights_file) in message and "truncated" in message
    with pytest.raises(CheckpointError, match="truncated"):
        cvllm.LLM(model=str(model), dtype="float32")


@pytest.mark.parametrize("keep", [0, 5, 40])
def test_truncated_inside_the_header(tmp_path, keep):
    model = write_checkpoint(tmp_path)
    weights_file = model / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:keep])
    with pytest.raises(CheckpointError) as info:
        read_all(model)
    assert str(weights_file) in str(info.value) and "truncated" in str(info.value)


def write_raw_safetensors(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


NO_OFFSETS = "tensor 'w' has no valid data_offsets"


@pytest.mark.parametrize("header, expected", [
    pytest.param(b"{not json at all}", "corrupt safetensors header", id="not-json"),
    pytest.param(b"\xff\xfe{}", "corrupt safetensors header", id="not-utf8"),
    pytest.param(b"[1, 2, 3]", "corrupt safetensors header", id="json-list"),
    pytest.param(b'{"w": {"dtype": "F32", "shape": [2]}}', NO_OFFSETS, id="no-offsets"),
    pytest.param(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}', NO_OFFSETS, id="one-offset"),
    pytest.param(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}', NO_OFFSETS,
                 id="string-offsets"),
    pytest.param(b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 80]}}', "truncated", id="past-end"),
])
def test_corrupt_header(tmp_path, header, expected):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    weights_file = tmp_path / "model.safetensors"
    write_raw_safetensors(weights_file, header, b"\0" * 8)
    with pytest.raises(CheckpointError) as info:
        read_all(tmp_path)
    assert str(info.value).startswith(f"{weights_file}: ")
    assert expected in str(info.value)


def test_corrupt_header_message(tmp_path):
    model = write_checkpoint(tmp_path)
    weights_file = model / "model.safetensors"
    blob = bytearray(weights_file.read_bytes())
    blob[8] = ord("#")  # the header's opening brace
    weights_file.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=f"{weights_file}: corrupt safetensors header"):
        list(iterate_safetensors([weights_file]))


def test_sharded_index_listing_a_missing_shard(tmp_path):
    weights = llama_weights()
    names = sorted(weights)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    save_file({n: weights[n] for n in first}, str(tmp_path / "model-00001-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError) as info:
        open_hf_checkpoint(tmp_path)
    message = str(info.value)
    assert "model.safetensors.index.json" in message and "model-00002-of-00002.safetensors" in message
    assert "model-00001-of-00002.safetensors" not in message.split(":", 1)[1]

    save_file({n: weights[n] for n in second}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert sorted(read_all(tmp_path)) == names  # complete now: both shards are read


def test_index_without_weight_map(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="no 'weight_map'"):
        open_hf_checkpoint(tmp_path)


def test_tensor_with_the_wrong_shape_names_the_parameter(tmp_path):
    weights = llama_weights()
    weights["model.layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER + 1)
    model = write_checkpoint(tmp_path, weights)
    with pytest.raises(CheckpointError) as info:
        cvllm.LLM(model=str(model), dtype="float32")
    message = str(info.value)
    assert "model.layers.0.mlp.down_proj.weight" in message
    assert "(32, 65)" in message and "(32, 64)" in message
    assert message.startswith(f"{model / 'model.safetensors'}: ")   # the one file of the directory


def test_a_sharded_checkpoints_wrong_tensor_names_its_shard(tmp_path):
    """The index says which file holds the tensor that does not fit; that file is named."""
    weights = llama_weights()
    weights["model.layers.0.mlp.down_proj.weight"] = torch.zeros(HIDDEN, INTER + 1)
    tmp_path.joinpath("config.json").write_text(json.dumps(CONFIG))
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in shards.items():
        save_file({name: weights[name] for name in part}, str(tmp_path / file))
    weight_map = {name: file for file, part in shards.items() for name in part}
    tmp_path.joinpath("model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError) as info:
        cvllm.LLM(model=str(tmp_path), dtype="float32")
    shard = weight_map["model.layers.0.mlp.down_proj.weight"]
    assert str(info.value).startswith(f"{tmp_path / shard}: cannot load 'model.layers.0.mlp.down_proj.weight'")


def test_fused_shard_with_the_wrong_shape_names_the_checkpoint_tensor(tmp_path):
    weights = llama_weights()
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(HIDDEN // 2, HIDDEN)
    model = write_checkpoint(tmp_path, weights)
    with pytest.raises(CheckpointError) as info:
        cvllm.LLM(model=str(model), dtype="float32")
    assert "model.layers.0.self_attn.k_proj.weight" in str(info.value)
    assert "qkv_proj" in str(info.value)


@pytest.mark.parametrize("dropped, named", [
    ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
    # the model's fused parameter is what is missing in part
    ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.qkv_proj.weight"),
])
def test_missing_tensor_is_named(tmp_path, dropped, named):
    weights = llama_weights()
    del weights[dropped]
    model = write_checkpoint(tmp_path, weights)
    with pytest.raises(CheckpointError) as info:
        cvllm.LLM(model=str(model), dtype="float32")
    message = str(info.value)
    assert "missing" in message and named in message and str(model) in message
