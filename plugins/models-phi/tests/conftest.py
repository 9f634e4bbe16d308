"""Fixtures for the Phi tests: tiny random Phi-2 and Phi-3 checkpoints (built once per session, config.json in the
published Phi layout), the engine helpers the oracle tests share, and a per-position LongRoPE reference."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cvllm import plugins
from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE, make_checkpoint, register_tiny_architecture
from cvllm.testing.threads import one_torch_thread as _one_torch_thread
from cvllm_phi import plugin

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Phi-2's shape at toy size: as many K/V heads as query heads, 40% of each head rotated (16 * 0.4 -> 6 dims)
register_tiny_architecture("phi", "PhiConfig", "PhiForCausalLM", num_key_value_heads=4, partial_rotary_factor=0.4,
                           hidden_act="gelu_new", layer_norm_eps=1e-5)
register_tiny_architecture("phi3", "Phi3Config", "Phi3ForCausalLM")

@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)


def published_phi_layout(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json as Microsoft's Phi checkpoints spell it: ``partial_rotary_factor`` and
    ``original_max_position_embeddings`` at the top level, rope_scaling's ``type`` (``su`` kept as written),
    ``rope_scaling: null`` without scaling."""
    scaling = dict(raw.get("rope_scaling") or {})
    if "partial_rotary_factor" in scaling:
        raw["partial_rotary_factor"] = scaling.pop("partial_rotary_factor")
    original = scaling.pop("original_max_position_embeddings", None)
    if original is not None:
        raw.setdefault("original_max_position_embeddings", original)
    if scaling.get("rope_type", "default") == "default":
        raw["rope_scaling"] = None
    else:
        scaling["type"] = scaling.pop("rope_type")
        raw["rope_scaling"] = scaling
    return raw


@pytest.fixture(scope="session")
def phi_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyCheckpoint]:
    """``phi_checkpoint(arch, spelling="published" | "v5", **config_overrides)``, cached per arguments."""
    built: dict[str, TinyCheckpoint] = {}

    def build(arch: str, spelling: str = "published", **overrides: Any) -> TinyCheckpoint:
        key = json.dumps([arch, spelling, overrides], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{len(built)}")
            # transformers' Phi3Config rejects "su"; it reads the same parameters as "longrope"
            rope = overrides.get("rope_parameters") or {}
            hf_overrides = {**overrides, "rope_parameters": {**rope, "rope_type": "longrope"}} \
                if rope.get("rope_type") == "su" else overrides
            model = make_checkpoint(path, arch, spelling="v5" if spelling == "v5" else "published", **hf_overrides)
            if spelling != "v5":
                config_path = path / "config.json"
                raw = published_phi_layout(json.loads(config_path.read_text()))
                if rope.get("rope_type") == "su":
                    raw["rope_scaling"]["type"] = "su"
                config_path.write_text(json.dumps(raw, indent=2))
            built[key] = TinyCheckpoint(path, model)
        return built[key]

    return build


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    with _one_torch_thread():
        yield


@pytest.fixture(autouse=True)
def phi_plugin_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The plugin's hooks registered directly: the tests behave the same whether or not it is installed."""
    monkeypatch.setenv("CVLLM_PLUGINS", "")
    plugins.reset_plugins()
    plugins.get_plugin_manager().register(plugin, name="phi")
    yield
    plugins.reset_plugins()


# ---- a per-position LongRoPE reference: transformers' model with a rotary that picks factors per position ----


class PerPositionLongRope(torch.nn.Module):
    """transformers' Phi3RotaryEmbedding with cvllm's rule: short factors below the original context, long ones
    from there on, whatever else is in the pass. The factors and the scale come from transformers' own longrope
    init, so only the rule differs."""

    def __init__(self, rope: torch.nn.Module):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.original = rope.config.rope_parameters["original_max_position_embeddings"]
        self.short, self.scale = ROPE_INIT_FUNCTIONS["longrope"](rope.config)
        self.long, _ = ROPE_INIT_FUNCTIONS["longrope"](rope.config, seq_len=self.original + 1)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = torch.where((position_ids < self.original)[..., None], self.short, self.long)  # [B, S, dim/2]
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(x.dtype), (emb.sin() * self.scale).to(x.dtype)


@pytest.fixture(scope="session")
def longrope_reference() -> Callable[[TinyCheckpoint], Any]:
    """``longrope_reference(checkpoint)``: a copy of its transformers Phi3 model whose rotary picks LongRoPE's
    factors per position (made once per checkpoint)."""
    made: dict[Path, Any] = {}

    def get(checkpoint: TinyCheckpoint) -> Any:
        if checkpoint.path not in made:
            made[checkpoint.path] = copy.deepcopy(checkpoint.model)
            made[checkpoint.path].model.rotary_emb = PerPositionLongRope(checkpoint.model.model.rotary_emb)
        return made[checkpoint.path]

    return get


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
    def oracle_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int = NEW_TOKENS,
                      margin_model: Any = None) -> list[list[int]]:
        """transformers' greedy tokens, checked to be far enough from a tie (on ``margin_model``'s full-sequence
        logits, the model itself by default) to be a fair reference."""
        from cvllm.testing import greedy_margins, hf_greedy

        outputs = hf_greedy(model, prompts, max_new_tokens)
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            margin = min(greedy_margins(margin_model or model, prompt, output))
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
        """Largest |ours - model's| over every position of every prompt (full-prompt logits, one pass)."""
        from cvllm.testing import hf_logits

        ours = llm.llm_engine.prompt_logits(prompts)
        return max((got.float().cpu() - hf_logits(model, p)).abs().max().item() for got, p in zip(ours, prompts))

    def check_preemption(self, checkpoint: TinyCheckpoint, seed: int = 16, oracle: Any = None) -> None:
        """Four prompts that fit the KV pool alone but not together: greedy equals transformers through
        preemption and recompute, and preemption really happened. ``oracle``: the transformers model to compare
        with (the checkpoint's by default)."""
        block_size = 16
        prompts = self.prompts((40, 38, 36, 34), seed=seed)
        blocks_needed = [-(-(len(p) + NEW_TOKENS) // block_size) for p in prompts]
        num_kv_blocks = max(blocks_needed) + 2  # every request fits alone, the batch does not
        assert sum(blocks_needed) > num_kv_blocks
        want = self.oracle_greedy(oracle or checkpoint.model, prompts)
        llm = self.llm(checkpoint, block_size=block_size, num_kv_blocks=num_kv_blocks)
        assert self.greedy(llm, prompts) == want
        assert llm.llm_engine.stats.preemptions > 0


@pytest.fixture(scope="session")
def harness() -> Harness:
    return Harness()
