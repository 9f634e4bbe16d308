"""Tiny Hugging Face checkpoints for oracle tests: random weights, a real tokenizer, safetensors files.

transformers is imported inside the functions: it is a test dependency, not a runtime one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from cvllm.testing.tokenizer import EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, write_tiny_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Spelling = Literal["published", "v5"]

TOKENIZER_VOCAB_SIZE = 512
EOS_TOKEN_ID = SPECIAL_TOKENS.index(EOS_TOKEN)
PAD_TOKEN_ID = SPECIAL_TOKENS.index(PAD_TOKEN)

# 0.02 (the HF default) gives logits so flat that greedy decoding meets near-ties (top-2 gaps of
# 1e-4 and less), which fp32 rounding differences between two correct implementations can flip.
# 0.2 gives logits with a spread of several units, so top-2 gaps are orders above fp32 noise.
INITIALIZER_RANGE = 0.2

BASE_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "initializer_range": INITIALIZER_RANGE,
    "bos_token_id": PAD_TOKEN_ID,  # as Qwen2's config does: the tokenizer itself adds no BOS
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": PAD_TOKEN_ID,
    "tie_word_embeddings": False,
}

# Config overrides that each exercise one feature of the architecture.
VARIANTS: dict[str, dict[str, Any]] = {
    "gqa": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "mha": {"num_attention_heads": 4, "num_key_value_heads": 4},
    "tied": {"tie_word_embeddings": True},
    "bias": {"attention_bias": True, "mlp_bias": True},
    # theta 10000 with head_dim 16 puts rotary frequencies in all three llama3 bands (kept,
    # smoothed, divided by factor) for original_max_position_embeddings=32.
    "llama3_rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    },
    "head_dim": {"head_dim": 32, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2},
    "sliding": {"sliding_window": 16},
}

# arch -> (transformers config class, model class, config defaults of the tiny model)
MOE_CONFIG = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # as small as the MLPs
# DeepSeek's multi-head latent attention at toy size: 4 heads, latent 32, rope 8 + nope 16 per head; 3 layers, the
# first dense (first_k_dense_replace), 8 routed experts in 2 groups (the best group wins), one shared expert
DEEPSEEK_CONFIG = {"num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
                   "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2,
                   "topk_group": 1, "routed_scaling_factor": 2.5}
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**MOE_CONFIG, "shared_expert_intermediate_size": 48}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**MOE_CONFIG, "head_dim": 16}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    {**DEEPSEEK_CONFIG, "q_lora_rank": None, "topk_method": "group_limited_greedy"}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**DEEPSEEK_CONFIG, "q_lora_rank": 24, "norm_topk_prob": True}),
}


def register_tiny_architecture(arch: str, config_class: str, model_class: str, **defaults: Any) -> None:
    """Make ``arch`` known to tiny_config / make_checkpoint: a model plugin's tests add their own families
    (transformers' config and model class names, and the config values of the tiny model over BASE_CONFIG)."""
    ARCHITECTURES[arch] = (config_class, model_class, defaults)


def tiny_config(arch: str = "llama", **overrides: Any):
    """The transformers config of a tiny model of `arch`, eager attention, fp32."""
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r} (known: {', '.join(ARCHITECTURES)})")
    config_name, _, defaults = ARCHITECTURES[arch]
    values = {**BASE_CONFIG, **defaults, **overrides}
    if arch == "llama" and "sliding_window" in values:
        raise ValueError("Llama has no sliding window; use arch='mistral'")
    return getattr(transformers, config_name)(attn_implementation="eager", **values)


def make_checkpoint(
    dir: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    spelling: Spelling = "published",
    shards: int = 1,
    fused_experts: bool = False,
    **config_overrides: Any,
) -> PreTrainedModel:
    """Build a random tiny model, save it as an HF checkpoint directory, return it (fp32, eval mode).

    `spelling="published"` rewrites config.json the way checkpoints on the hub spell it
    (`rope_theta`/`rope_scaling` top-level, `torch_dtype`, no `layer_types`, MoE's `num_experts`: transformers 5
    writes Qwen3-MoE's as `num_local_experts`); "v5" keeps what transformers 5 writes. `fused_experts` saves
    transformers' in-memory expert tensors (`experts.gate_up_proj`) instead of the per-expert ones
    `save_pretrained` writes by default.
    """
    import transformers

    if spelling not in ("published", "v5"):
        raise ValueError(f"spelling must be 'published' or 'v5', not {spelling!r}")
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **config_overrides)
    model_class = getattr(transformers, ARCHITECTURES[arch][1])

    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32).eval()
    randomize_norms_and_biases(model, seed)

    if fused_experts:
        model.save_pretrained(dir, safe_serialization=True, save_original_format=False)
    else:
        save_sharded(model, dir, shards)
    if spelling == "published":
        config_path = dir / "config.json"
        raw = published_spelling(json.loads(config_path.read_text()))
        if arch not in ("llama", "mistral"):  # published Qwen configs list no layer_types
            raw.pop("layer_types", None)
        if "num_local_experts" in raw:
            raw["num_experts"] = raw.pop("num_local_experts")
        config_path.write_text(json.dumps(raw, indent=2))
    write_tiny_tokenizer(dir, vocab_size=TOKENIZER_VOCAB_SIZE)
    return model


# How config.json names a partial rotary fraction: "hub" as GLM's and StableLM's checkpoints are published (a
# top-level partial_rotary_factor, rope_theta, no rope_scaling), "v5" as transformers 5 writes it (inside
# rope_parameters), "absent" not at all (the loader must then take the architecture's default).
ROTARY_SPELLINGS = ("hub", "v5", "absent")


def make_partial_rotary_checkpoint(dir: Path, arch: str, rotary: str = "hub", **kwargs: Any) -> PreTrainedModel:
    """``make_checkpoint`` for an architecture whose config has ``partial_rotary_factor``, spelled as ``rotary``
    (one of ROTARY_SPELLINGS) says."""
    if rotary not in ROTARY_SPELLINGS:
        raise ValueError(f"rotary must be one of {ROTARY_SPELLINGS}, not {rotary!r}")
    model = make_checkpoint(dir, arch, spelling="v5" if rotary == "v5" else "published", **kwargs)
    if rotary != "v5":
        config_path = Path(dir) / "config.json"
        raw = json.loads(config_path.read_text())
        scaling = dict(raw.get("rope_scaling") or {})   # the published spelling left the fraction in here
        factor = scaling.pop("partial_rotary_factor")
        if rotary == "hub":
            raw["partial_rotary_factor"] = factor
        raw["rope_scaling"] = None if set(scaling) <= {"rope_type"} else scaling
        config_path.write_text(json.dumps(raw, indent=2))
    return model


def randomize_norms_and_biases(model: torch.nn.Module, seed: int) -> None:
    """HF initializes norm weights to 1 and biases to 0: a loader that skipped them would pass."""
    generator = torch.Generator().manual_seed(seed + 1)
    std = model.config.initializer_range
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(".bias"):
                param.copy_(std * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():   # DeepSeek-V3's routing bias, zeros as initialised
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def save_sharded(model: PreTrainedModel, dir: Path, shards: int) -> None:
    """save_pretrained, with a shard size that gives exactly `shards` safetensors files."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    if shards == 1:
        model.save_pretrained(dir, safe_serialization=True)
        return
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shard_bytes = math.ceil(total_bytes / shards)
    # transformers fills shards greedily, tensor by tensor, so the first guess can give one shard
    # too many; grow the limit until the count is right.
    for _ in range(50):
        for old in dir.glob("model*.safetensors*"):
            old.unlink()
        model.save_pretrained(dir, safe_serialization=True, max_shard_size=shard_bytes)
        written = len(list(dir.glob("model-*.safetensors")))
        if written == shards:
            return
        if written < shards:
            break
        shard_bytes = int(shard_bytes * 1.05) + 1
    raise ValueError(f"cannot split this model into exactly {shards} shards")


def published_spelling(config: dict[str, Any]) -> dict[str, Any]:
    """Rewrite a transformers-5 config dict in the spelling of published hub checkpoints."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters", None) or {})
    if rope:
        config["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.get("rope_type", "default")
        config["rope_scaling"] = None if rope_type == "default" and len(rope) <= 1 else rope
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    return config


def hf_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """fp32 logits [L, V] of every position of one prompt, from one full forward pass."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(
    model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int, *, suppress_eos: bool = False
) -> list[list[int]]:
    """Greedy continuations from transformers' `generate`, each prompt alone (no padding).

    Default: exactly `max_new_tokens` tokens, EOS may be generated but does not stop (vLLM's
    `ignore_eos=True`). `suppress_eos=True` instead masks EOS until max_new_tokens, as
    `min_new_tokens` does (vLLM's `min_tokens=max_tokens`).
    """
    stop_kwargs: dict[str, Any] = (
        {"min_new_tokens": max_new_tokens} if suppress_eos else {"eos_token_id": []}  # [] = never stop
    )
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=PAD_TOKEN_ID,
                **stop_kwargs,
            )
            new_tokens = out[0, len(prompt) :].tolist()
            assert len(new_tokens) == max_new_tokens, (len(new_tokens), max_new_tokens)
            outputs.append(new_tokens)
    return outputs


def greedy_logprobs(path, prompts: list[list[int]], max_tokens: int, **llm_options: Any
                    ) -> tuple[list[tuple[list[int], list[float]]], set[str]]:
    """Greedy continuations (``ignore_eos``) with each chosen token's logprob, and the class names of the
    LinearMethods of the first decoder layer's linear layers (which quantization took the model)."""
    from cvllm import LLM, SamplingParams
    from cvllm.layers.linear import LinearBase

    llm = LLM(str(path), **llm_options)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        layer = llm.llm_engine.runner.model.model.layers[0]
        kinds = {type(m.quant_method).__name__ for m in layer.modules() if isinstance(m, LinearBase)}
    finally:
        llm.shutdown()
    return [(list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs,
                                                                      o.outputs[0].token_ids)])
            for o in outputs], kinds


def cvllm_greedy(path, prompts: list[list[int]], max_tokens: int, **llm_options: Any) -> list[list[int]]:
    """Greedy continuations (``ignore_eos``) of the prompts from an ``LLM`` built with ``llm_options``, which is
    shut down afterwards (tensor-parallel workers end with it)."""
    from cvllm import LLM, SamplingParams

    llm = LLM(str(path), **llm_options)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy_margins(model: PreTrainedModel, prompt: list[int], continuation: list[int]) -> list[float]:
    """Top-1 minus top-2 logit at each step that produced `continuation`: how far from a tie it was."""
    logits = hf_logits(model, prompt + continuation)[len(prompt) - 1 : -1]
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()
