"""Write a Llama-shaped checkpoint with random weights (for benchmarks; never all zeros)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SHAPES = {
    # SmolLM2-135M's shape (the demo model of DESIGN.md §10)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0,
                 max_position_embeddings=2048, rms_norm_eps=1e-5),
}


def write_random_llama(path: Path, shape: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    cfg = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               torch_dtype=str(dtype).removeprefix("torch."), bos_token_id=0, eos_token_id=0)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
            p + "mlp.gate_proj.weight": rand(i, h), p + "mlp.up_proj.weight": rand(i, h),
            p + "mlp.down_proj.weight": rand(h, i),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
