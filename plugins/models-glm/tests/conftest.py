"""Fixtures for the GLM tests: tiny random GLM-4 / GLM-4-0414 checkpoints (built once per session) and the engine
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

from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE, make_checkpoint, register_tiny_architecture
from cvllm.testing.threads import one_torch_thread as _one_torch_thread

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# head_dim 16 (transformers' GLM default is 128): partial rotary turns 8 features a head, 4 pairs
register_tiny_architecture("glm", "GlmConfig", "GlmForCausalLM", head_dim=16)
register_tiny_architecture("glm4", "Glm4Config", "Glm4ForCausalLM", head_dim=16)

# How config.json names the rotary fraction: "hub" as THUDM/zai-org publish it (top-level partial_rotary_factor,
# rope_theta, no rope_scaling), "v5" as transformers 5 writes it (inside rope_parameters), "absent" not at all
# (transformers' GLM configs then default to 0.5).
ROTARY_SPELLINGS = ("hub", "v5", "absent")


@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)


def _respell_rotary(path: Path, rotary: str) -> None:
    config_path = path / "config.json"
    raw = json.loads(config_path.read_text())
    scaling = dict(raw.get("rope_scaling") or {})
    factor = scaling.pop("partial_rotary_factor")
    if rotary == "hub":
        raw["partial_rotary_factor"] = factor
    raw["rope_scaling"] = None if set(scaling) <= {"rope_type"} else scaling
    config_path.write_text(json.dumps(raw, indent=2))


@pytest.fixture(scope="session")
def glm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., TinyCheckpoint]:
    """``glm_checkpoint(arch, rotary=..., shards=..., **config_overrides)``, cached."""
    built: dict[str, TinyCheckpoint] = {}

    def build(arch: str, rotary: str = "hub", **kwargs: Any) -> TinyCheckpoint:
        assert rotary in ROTARY_SPELLINGS, rotary
        key = json.dumps([arch, rotary, kwargs], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{len(built)}")
            model = make_checkpoint(path, arch, spelling="v5" if rotary == "v5" else "published", **kwargs)
            if rotary != "v5":
                _respell_rotary(path, rotary)
            built[key] = TinyCheckpoint(path, model)
        return built[key]

    return build


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    with _one_torch_thread():
        yield


# ---- the engine side of the oracle tests ----

# The oracle's top-1 must beat its top-2 by this much at every greedy step; below it, fp32 rounding
# differences between two correct implementations could pick the other token.
MIN_GREEDY_MARGIN = 1e-3
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32", "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
    "enable_prefix_caching": True,
}


class Harness:
    """What the oracle tests do again and again: prompts, transformers' greedy tokens, ours."""

    LOGITS_ATOL = 1e-4
    NEW_TOKENS = 16

    @staticmethod
    def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
        """Random non-special token ids (0..2 are the special tokens)."""
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(3, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]

    def oracle_greedy(self, model: Any, prompts: list[list[int]]) -> list[list[int]]:
        """transformers' greedy tokens, checked to be far enough from a tie to be a fair reference."""
        from cvllm.testing import greedy_margins, hf_greedy

        outputs = hf_greedy(model, prompts, self.NEW_TOKENS)
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            margin = min(greedy_margins(model, prompt, output))
            assert margin > MIN_GREEDY_MARGIN, f"oracle near-tie on prompt {i} (margin {margin:.2e}): pick others"
        return outputs

    @staticmethod
    def llm(checkpoint: TinyCheckpoint, **overrides: Any):
        from cvllm import LLM

        return LLM(model=str(checkpoint.path), **{**ENGINE_DEFAULTS, **overrides})

    def greedy(self, llm: Any, prompts: list[list[int]]) -> list[list[int]]:
        from cvllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def check_preemption(self, checkpoint: TinyCheckpoint, seed: int = 16) -> None:
        """Four prompts that fit the KV pool alone but not together: greedy equals transformers through
        preemption and recompute, and preemption really happened."""
        block_size = 16
        prompts = self.prompts((40, 38, 36, 34), seed=seed)
        blocks_needed = [-(-(len(p) + self.NEW_TOKENS) // block_size) for p in prompts]
        num_kv_blocks = max(blocks_needed) + 2  # every request fits alone, the batch does not
        assert sum(blocks_needed) > num_kv_blocks
        want = self.oracle_greedy(checkpoint.model, prompts)
        llm = self.llm(checkpoint, block_size=block_size, num_kv_blocks=num_kv_blocks)
        assert self.greedy(llm, prompts) == want
        assert llm.llm_engine.stats.preemptions > 0

    @staticmethod
    def max_logits_diff(llm: Any, model: Any, prompts: list[list[int]]) -> float:
        """Largest |ours - transformers'| over every position of every prompt (full-prompt logits)."""
        from cvllm.testing import hf_logits

        ours = llm.llm_engine.prompt_logits(prompts)
        return max((got.float().cpu() - hf_logits(model, p)).abs().max().item() for got, p in zip(ours, prompts))


@pytest.fixture(scope="session")
def harness() -> Harness:
    return Harness()
