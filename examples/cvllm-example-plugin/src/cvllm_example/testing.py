"""A random TinyGPT checkpoint on disk, in the layout cvllm's Hugging Face reader expects:
``config.json`` plus ``model.safetensors`` with the model's parameter names. No tokenizer: prompts
are given as token ids.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["TinyGPTForCausalLM"],
    "model_type": "tinygpt",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "gelu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

# Hugging Face initialises with std 0.02, which leaves logits so flat that greedy decoding meets
# near-ties that fp32 rounding can flip. 0.2 gives logits several units apart.
WEIGHT_STD = 0.2


def checkpoint_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a TinyGPT checkpoint, by name."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        block = f"transformer.h.{i}"
        shapes[f"{block}.ln_1.weight"] = (hidden,)
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{block}.attn.{proj}.weight"] = (hidden, hidden)
        shapes[f"{block}.ln_2.weight"] = (hidden,)
        shapes[f"{block}.mlp.fc_in.weight"] = (inter, hidden)
        shapes[f"{block}.mlp.fc_in.bias"] = (inter,)
        shapes[f"{block}.mlp.fc_out.weight"] = (hidden, inter)
        shapes[f"{block}.mlp.fc_out.bias"] = (hidden,)
    shapes["transformer.ln_f.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def make_checkpoint(path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> Path:
    """Write a TinyGPT checkpoint with random weights (reproducible from ``seed``) to ``path``;
    ``overrides`` replace keys of ``TINY_CONFIG``. Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **overrides}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        # norm scales near 1, so each layer neither erases nor blows up the residual stream
        tensors[name] = 1.0 + 0.1 * noise if "ln_" in name else WEIGHT_STD * noise
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
