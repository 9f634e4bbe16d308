"""Llama/Qwen-shaped checkpoints with random weights, for benchmarks (never all zeros): written to disk
(``write_random_llama``, through the real loader) or built in memory on the device (``random_checkpoint``:
an 8B model in seconds, where writing and reading 16 GB of safetensors would take minutes).

An in-memory checkpoint pickles (its weight iterator is a partial of a module-level function), so tensor-parallel
workers, which are sent the checkpoint, draw the same tensors again on their own device from the same seed and keep
their shard of them; the script that builds it must leave this directory on ``sys.path`` (spawned workers inherit
it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

if TYPE_CHECKING:
    from cvllm.checkpoint.base import Checkpoint

SHAPES = {
    # SmolLM2-135M's shape (the demo model, core/src/cvllm/demo.py)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192, rms_norm_eps=1e-5),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5),
    # Llama-3-70B's shape: 141 GB of bf16 weights, more than one H200 holds (tensor parallelism over 2 or 4)
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                       max_position_embeddings=8192, rms_norm_eps=1e-5),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       architecture="Qwen3ForCausalLM"),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0,
                 max_position_embeddings=2048, rms_norm_eps=1e-5),
    # the tiny shape on Qwen3's architecture (q/k norms, explicit head_dim): CPU rehearsals of Qwen3 benchmarks
    "tiny-qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
                       architecture="Qwen3ForCausalLM"),
}


def shape_config(shape: str, dtype: torch.dtype) -> dict:
    cfg = dict(SHAPES[shape])
    architecture = cfg.pop("architecture", "LlamaForCausalLM")
    model_type = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}[architecture]
    return dict(cfg, architectures=[architecture], model_type=model_type, hidden_act="silu",
                torch_dtype=str(dtype).removeprefix("torch."), bos_token_id=0, eos_token_id=0)


def random_checkpoint(shape: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> Checkpoint:
    """An in-memory checkpoint whose tensors are drawn on ``device`` as the loader asks for them; the
    engine loads it like any other (EngineConfig(model=checkpoint)). It pickles: a tensor-parallel worker draws
    the same tensors on its own ``device`` (``"cuda"``: the device it bound) and keeps its shard."""
    from cvllm.checkpoint.base import Checkpoint
    from cvllm.config import model_config_from_dict

    cfg = shape_config(shape, dtype)
    config = model_config_from_dict(cfg, f"random:{shape}")
    return Checkpoint(path=Path(f"random-{shape}"), config=config,
                      weight_iterator=partial(random_tensors, cfg, dtype, str(device), seed), format="random")


def random_tensors(cfg: dict, dtype: torch.dtype, device: str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of ``cfg``'s shape, drawn in a fixed order from one generator seeded ``seed``:
    the same tensors in every process on the same kind of device."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    qwen3 = cfg["architectures"][0] == "Qwen3ForCausalLM"
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * std).to(dtype)

    def ones(n: int) -> torch.Tensor:  # norms near 1, not exactly (never a constant tensor)
        return (1 + rand(n, std=0.01)).to(dtype)

    yield "model.embed_tokens.weight", rand(v, h)
    yield "model.norm.weight", ones(h)
    if not cfg["tie_word_embeddings"]:
        yield "lm_head.weight", rand(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        yield p + "self_attn.q_proj.weight", rand(heads * d, h)
        yield p + "self_attn.k_proj.weight", rand(kv_heads * d, h)
        yield p + "self_attn.v_proj.weight", rand(kv_heads * d, h)
        yield p + "self_attn.o_proj.weight", rand(h, heads * d)
        if qwen3:
            yield p + "self_attn.q_norm.weight", ones(d)
            yield p + "self_attn.k_norm.weight", ones(d)
        yield p + "mlp.gate_proj.weight", rand(i, h)
        yield p + "mlp.up_proj.weight", rand(i, h)
        yield p + "mlp.down_proj.weight", rand(h, i)
        yield p + "input_layernorm.weight", ones(h)
        yield p + "post_attention_layernorm.weight", ones(h)


def write_random_llama(path: Path, shape: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       device: str = "cpu") -> Path:
    """``device``: where the random numbers are drawn (an 8B model's take minutes on a CPU, seconds on a GPU)."""
    cfg = shape_config(shape, dtype)
    if cfg["architectures"] != ["LlamaForCausalLM"]:
        raise ValueError(f"write_random_llama writes Llama shapes only; use random_checkpoint for '{shape}'")
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype).cpu()

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


def hf_model(shape: str, device: str, dtype: torch.dtype = torch.bfloat16):
    """transformers' model of the shape's config (the benchmarks' reference), random weights drawn on
    ``device``."""
    import transformers

    cfg = shape_config(shape, dtype)
    hf_config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items()
                                                                         if k not in ("model_type", "torch_dtype")})
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
