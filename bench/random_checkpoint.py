"""Llama/Qwen/MoE/DeepSeek-shaped checkpoints with random weights, for benchmarks (never all zeros): written to disk
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
    # Llama-3.2-1B's shape: Llama-3-8B's vocabulary, the draft model for it (bench/speculative.py)
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
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
# mixtures of experts (issue 19): Qwen3-30B-A3B (128 experts, top-8) and DeepSeek-V2-Lite (MLA, 64 experts,
# top-6, 2 shared, the first layer dense), and their tiny rehearsals
_QWEN3_MOE = dict(architecture="Qwen3MoeForCausalLM", norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
_DEEPSEEK_V2 = dict(architecture="DeepseekV2ForCausalLM", q_lora_rank=None, topk_method="greedy", n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=1)
SHAPES |= {
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, **_QWEN3_MOE),
    "deepseek-v2-lite": dict(hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, vocab_size=102400, tie_word_embeddings=False, rope_theta=10000.0,
                             max_position_embeddings=163840, rms_norm_eps=1e-6, kv_lora_rank=512,
                             qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64,
                             num_experts_per_tok=6, n_shared_experts=2, moe_intermediate_size=1408,
                             rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                           "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                                           "mscale_all_dim": 0.707},
                             **_DEEPSEEK_V2),
    "tiny-qwen3-moe": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                           rope_theta=1000000.0, max_position_embeddings=2048, rms_norm_eps=1e-6, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, **_QWEN3_MOE),
    "tiny-deepseek-v2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=512, tie_word_embeddings=True, rope_theta=10000.0,
                             max_position_embeddings=2048, rms_norm_eps=1e-6, kv_lora_rank=32, qk_rope_head_dim=16,
                             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                             n_shared_experts=1, moe_intermediate_size=32, **_DEEPSEEK_V2),
}
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                "DeepseekV2ForCausalLM": "deepseek_v2"}


def shape_config(shape: str, dtype: torch.dtype) -> dict:
    cfg = dict(SHAPES[shape])
    architecture = cfg.pop("architecture", "LlamaForCausalLM")
    model_type = _MODEL_TYPES[architecture]
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
    architecture = cfg["architectures"][0]
    qwen3 = architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
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
        if architecture == "DeepseekV2ForCausalLM":
            yield from _mla_tensors(p, cfg, rand, ones)
        else:
            yield p + "self_attn.q_proj.weight", rand(heads * d, h)
            yield p + "self_attn.k_proj.weight", rand(kv_heads * d, h)
            yield p + "self_attn.v_proj.weight", rand(kv_heads * d, h)
            yield p + "self_attn.o_proj.weight", rand(h, heads * d)
        if qwen3:
            yield p + "self_attn.q_norm.weight", ones(d)
            yield p + "self_attn.k_norm.weight", ones(d)
        experts = cfg.get("num_experts") or cfg.get("n_routed_experts")
        if experts and n >= cfg.get("first_k_dense_replace", 0):
            moe_i = cfg["moe_intermediate_size"]
            yield p + "mlp.gate.weight", rand(experts, h)
            # stacked [E, out, in], a form the expert loader takes (as GGUF files hold them)
            yield p + "mlp.experts.gate_proj.weight", rand(experts, moe_i, h)
            yield p + "mlp.experts.up_proj.weight", rand(experts, moe_i, h)
            yield p + "mlp.experts.down_proj.weight", rand(experts, h, moe_i)
            if cfg.get("n_shared_experts"):
                shared = moe_i * cfg["n_shared_experts"]
                yield p + "mlp.shared_experts.gate_proj.weight", rand(shared, h)
                yield p + "mlp.shared_experts.up_proj.weight", rand(shared, h)
                yield p + "mlp.shared_experts.down_proj.weight", rand(h, shared)
        else:
            yield p + "mlp.gate_proj.weight", rand(i, h)
            yield p + "mlp.up_proj.weight", rand(i, h)
            yield p + "mlp.down_proj.weight", rand(h, i)
        yield p + "input_layernorm.weight", ones(h)
        yield p + "post_attention_layernorm.weight", ones(h)


def _mla_tensors(p: str, cfg: dict, rand, ones) -> Iterator[tuple[str, torch.Tensor]]:
    """DeepSeek-V2's multi-head latent attention (no q_lora, as V2-Lite)."""
    h, heads, latent = cfg["hidden_size"], cfg["num_attention_heads"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    yield p + "self_attn.q_proj.weight", rand(heads * (nope + rope), h)
    yield p + "self_attn.kv_a_proj_with_mqa.weight", rand(latent + rope, h)
    yield p + "self_attn.kv_a_layernorm.weight", ones(latent)
    yield p + "self_attn.kv_b_proj.weight", rand(heads * (nope + v), latent)
    yield p + "self_attn.o_proj.weight", rand(h, heads * v)


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
