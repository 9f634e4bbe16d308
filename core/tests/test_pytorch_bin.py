"""Model directories with PyTorch ``.bin`` weights and no safetensors (older hub checkpoints): one file and an
index of shards give the tokens the safetensors copy of the same weights gives."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from cvllm.testing import cvllm_greedy, make_checkpoint

PROMPTS = [[5, 17, 33, 2, 90, 1, 44], [7, 8, 9]]


def test_bin_files_load_like_safetensors(tmp_path):
    source = tmp_path / "safetensors"
    make_checkpoint(source, "llama")
    want = cvllm_greedy(source, PROMPTS, 6, dtype="float32", num_kv_blocks=32)
    state = {name: tensor for f in sorted(source.glob("*.safetensors")) for name, tensor in load_file(f).items()}

    single = tmp_path / "single"
    single.mkdir()
    for f in source.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (single / f.name).write_bytes(f.read_bytes())
    torch.save(state, single / "pytorch_model.bin")
    assert cvllm_greedy(single, PROMPTS, 6, dtype="float32", num_kv_blocks=32) == want

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in single.iterdir():
        if f.suffix != ".bin":
            (sharded / f.name).write_bytes(f.read_bytes())
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in halves.items():
        torch.save({name: state[name] for name in part}, sharded / file)
    weight_map = {name: file for file, part in halves.items() for name in part}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert cvllm_greedy(sharded, PROMPTS, 6, dtype="float32", num_kv_blocks=32) == want
