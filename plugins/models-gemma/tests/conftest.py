"""Fixtures for the Gemma tests: tiny random Gemma, Gemma 2, Gemma 3 and Gemma 3 multimodal checkpoints (built once
per session, in the spellings the hub and transformers 5 write), and the engine helpers the oracle tests share."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE, make_checkpoint
from cvllm.testing.threads import one_torch_thread as _one_torch_thread
from cvllm_gemma.testing import gemma3_published, legacy_gelu, make_multimodal_checkpoint, register_tiny_gemmas

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
register_tiny_gemmas()


@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)


CheckpointFactory = Callable[..., TinyCheckpoint]


@pytest.fixture(scope="session")
def gemma_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``gemma_checkpoint(arch, spelling=..., **config_overrides)``, cached. ``arch``: gemma, gemma2, gemma3
    (``spelling="published"`` rewritten here: core's rewrite knows one rope only) or gemma3_multimodal
    (``layout=...``, ``spelling=...``)."""
    built: dict[str, TinyCheckpoint] = {}

    def build(arch: str, **kwargs: Any) -> TinyCheckpoint:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{len(built)}")
            if arch == "gemma3_multimodal":
                model = make_multimodal_checkpoint(path, **kwargs)
            elif arch == "gemma3" and kwargs.get("spelling") == "published":
                model = make_checkpoint(path, arch, **{**kwargs, "spelling": "v5"})
                gemma3_published(path)
            else:
                model = make_checkpoint(path, arch, **kwargs)
                if arch == "gemma" and kwargs.get("spelling", "published") == "published":
                    legacy_gelu(path)
            built[key] = TinyCheckpoint(path, model)
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

    def check_preemption(self, checkpoint: TinyCheckpoint) -> None:
        """Four prompts that fit the KV pool alone but not together: greedy equals transformers through
        preemption and recompute, and preemption really happened."""
        block_size = 16
        prompts = self.prompts((40, 38, 36, 34), seed=16)
        blocks_needed = [-(-(len(p) + NEW_TOKENS) // block_size) for p in prompts]
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
