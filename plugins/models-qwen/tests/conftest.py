"""Fixtures for the Qwen oracle tests: tiny random Qwen checkpoints (built once per session) and the engine
helpers the oracle tests share."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cvllm.testing.checkpoints import (
    BASE_CONFIG,
    TOKENIZER_VOCAB_SIZE,
    _randomize_norms_and_biases,
    _save_sharded,
    published_spelling,
)
from cvllm.testing.threads import one_torch_thread as _one_torch_thread
from cvllm.testing.tokenizer import write_tiny_tokenizer

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# arch -> (transformers config class, model class)
ARCHITECTURES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
# 8 experts, top-2, as small as the dense layers
MOE_CONFIG = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "qwen2_moe": {**MOE_CONFIG, "shared_expert_intermediate_size": 48},
    "qwen3_moe": {**MOE_CONFIG, "head_dim": 16},
}


@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)


def make_qwen_checkpoint(dir: Path, arch: str, *, spelling: str = "published", shards: int = 1,
                         fused_experts: bool = False, seed: int = 0, **overrides: Any) -> Any:
    """A random tiny Qwen model saved as an HF checkpoint directory, with the shared tiny tokenizer.

    ``spelling="published"`` writes config.json as hub checkpoints spell it: rope_theta/torch_dtype, no
    ``layer_types``, and ``num_experts`` (transformers 5 writes Qwen3-MoE's as ``num_local_experts``).
    ``fused_experts`` saves transformers' in-memory expert tensors (``experts.gate_up_proj``) instead of
    the per-expert ones ``save_pretrained`` writes by default.
    """
    import transformers

    config_name, model_name = ARCHITECTURES[arch]
    values = {**BASE_CONFIG, **ARCH_DEFAULTS[arch], **overrides}
    config = getattr(transformers, config_name)(attn_implementation="eager", **values)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    _randomize_norms_and_biases(model, seed)
    if fused_experts:
        model.save_pretrained(dir, safe_serialization=True, save_original_format=False)
    else:
        _save_sharded(model, dir, shards)
    if spelling == "published":
        path = dir / "config.json"
        raw = published_spelling(json.loads(path.read_text()))
        raw.pop("layer_types", None)
        if "num_local_experts" in raw:
            raw["num_experts"] = raw.pop("num_local_experts")
        path.write_text(json.dumps(raw, indent=2))
    write_tiny_tokenizer(dir, vocab_size=TOKENIZER_VOCAB_SIZE)
    return model


CheckpointFactory = Callable[..., TinyCheckpoint]


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``qwen_checkpoint(arch, spelling=..., shards=..., fused_experts=..., **config_overrides)``, cached."""
    built: dict[str, TinyCheckpoint] = {}

    def build(arch: str, **kwargs: Any) -> TinyCheckpoint:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{len(built)}")
            built[key] = TinyCheckpoint(path, make_qwen_checkpoint(path, arch, **kwargs))
        return built[key]

    return build


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    with _one_torch_thread():
        yield


# ---- the engine side of the oracle tests ----

LOGITS_ATOL = 1e-4
# The oracle's top-1 must beat its top-2 by this much at every greedy step; below it, fp32 rounding
# differences between two correct implementations could pick the other token.
MIN_GREEDY_MARGIN = 1e-3
NEW_TOKENS = 16
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
    "enable_prefix_caching": True,
}


class Harness:
    """What the oracle tests do again and again: prompts, transformers' greedy tokens, ours."""

    LOGITS_ATOL = LOGITS_ATOL
    NEW_TOKENS = NEW_TOKENS

    @staticmethod
    def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
        """Random non-special token ids (0..2 are the special tokens)."""
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(3, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]

    @staticmethod
    def oracle_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int = NEW_TOKENS) -> list[list[int]]:
        """transformers' greedy tokens, checked to be far enough from a tie to be a fair reference."""
        from cvllm.testing import greedy_margins, hf_greedy

        outputs = hf_greedy(model, prompts, max_new_tokens)
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            margin = min(greedy_margins(model, prompt, output))
            assert margin > MIN_GREEDY_MARGIN, f"oracle near-tie on prompt {i} (margin {margin:.2e}): pick others"
        return outputs

    @staticmethod
    def llm(checkpoint: TinyCheckpoint, **overrides: Any):
        from cvllm import LLM

        return LLM(model=str(checkpoint.path), **{**ENGINE_DEFAULTS, **overrides})

    @staticmethod
    def greedy(llm: Any, prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
        from cvllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(out.outputs[0].token_ids) for out in outputs]

    @staticmethod
    def max_logits_diff(llm: Any, model: Any, prompts: list[list[int]]) -> float:
        """Largest |ours - transformers'| over every position of every prompt (full-prompt logits)."""
        from cvllm.testing import hf_logits

        ours = llm.llm_engine.prompt_logits(prompts)
        return max((got.float().cpu() - hf_logits(model, p)).abs().max().item() for got, p in zip(ours, prompts))


@pytest.fixture(scope="session")
def harness() -> Harness:
    return Harness()
