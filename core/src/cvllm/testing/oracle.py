"""The harness of the model plugins' oracle tests: tiny checkpoints built once per session, and cvllm's prompt logits
and greedy tokens set against transformers'.

pytest and transformers are test dependencies: neither is imported here at run time (pytest's tmp_path_factory is
passed in; transformers is reached through cvllm.testing.checkpoints, which imports it inside its functions).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE, greedy_margins, hf_greedy, hf_logits, make_checkpoint

if TYPE_CHECKING:
    import pytest


@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)


CheckpointFactory = Callable[..., TinyCheckpoint]


def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory,
                       make: Callable[..., Any] = make_checkpoint) -> CheckpointFactory:
    """``factory(*args, **kwargs)``: the checkpoint ``make(dir, *args, **kwargs)`` writes in a fresh ``dir`` (and the
    model it returns), built once per distinct arguments: a session-scoped fixture returns it, as a checkpoint takes
    seconds to build and many tests share one."""
    signature = inspect.signature(make)
    built: dict[str, TinyCheckpoint] = {}

    def build(*args: Any, **kwargs: Any) -> TinyCheckpoint:
        # keyed on the arguments as ``make`` sees them, defaults filled in: a default spelled out builds nothing new
        bound = signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        key = json.dumps(list(bound.arguments.values())[1:], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{bound.arguments.get('arch', 'checkpoint')}-{len(built)}")
            built[key] = TinyCheckpoint(path, make(path, *args, **kwargs))
        return built[key]

    return build


class Harness:
    """What the oracle tests do again and again: prompts, transformers' greedy tokens, ours. A plugin whose models
    need other numbers overrides the class attributes in a subclass."""

    LOGITS_ATOL: ClassVar[float] = 1e-4
    # float32 on CUDA: the Triton kernels and cuBLAS sum in other orders than transformers on the CPU
    CUDA_LOGITS_ATOL: ClassVar[float] = 5e-3
    # The oracle's top-1 must beat its top-2 by this much at every greedy step; below it, fp32 rounding
    # differences between two correct implementations could pick the other token.
    MIN_GREEDY_MARGIN: ClassVar[float] = 1e-3
    NEW_TOKENS: ClassVar[int] = 16
    ENGINE_DEFAULTS: ClassVar[dict[str, Any]] = {
        "dtype": "float32", "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
        "enable_prefix_caching": True,
    }

    @staticmethod
    def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
        """Random non-special token ids (0..2 are the special tokens)."""
        generator = torch.Generator().manual_seed(seed)
        return [torch.randint(3, TOKENIZER_VOCAB_SIZE, (n,), generator=generator).tolist() for n in lengths]

    def oracle_greedy(self, model: Any, prompts: list[list[int]], max_new_tokens: int | None = None,
                      margin_model: Any = None) -> list[list[int]]:
        """transformers' greedy tokens, checked to be far enough from a tie (on ``margin_model``'s full-sequence
        logits, the model itself by default) to be a fair reference."""
        outputs = hf_greedy(model, prompts, self.NEW_TOKENS if max_new_tokens is None else max_new_tokens)
        for i, (prompt, output) in enumerate(zip(prompts, outputs)):
            margin = min(greedy_margins(model if margin_model is None else margin_model, prompt, output))
            assert margin > self.MIN_GREEDY_MARGIN, f"oracle near-tie on prompt {i} (margin {margin:.2e}): pick others"
        return outputs

    def llm(self, checkpoint: TinyCheckpoint, **overrides: Any):
        from cvllm import LLM

        return LLM(model=str(checkpoint.path), **{**self.ENGINE_DEFAULTS, **overrides})

    def greedy(self, llm: Any, prompts: list[list[int]], max_tokens: int | None = None) -> list[list[int]]:
        from cvllm import SamplingParams

        max_tokens = self.NEW_TOKENS if max_tokens is None else max_tokens
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(out.outputs[0].token_ids) for out in outputs]

    def check_cuda(self, checkpoint: TinyCheckpoint, prompts: list[list[int]], oracle: Any = None) -> None:
        """The checkpoint on the CUDA backend as users run it (CUDA graphs on, the default): transformers' greedy
        tokens for ``prompts`` run side by side, its prompt logits within CUDA_LOGITS_ATOL, and decode graphs
        captured. ``oracle``: the transformers model (the checkpoint's by default). For ``@pytest.mark.gpu``
        tests."""
        model = checkpoint.model if oracle is None else oracle
        want = self.oracle_greedy(model, prompts)
        llm = self.llm(checkpoint, backend="cuda")
        try:
            assert self.greedy(llm, prompts) == want
            assert getattr(llm.llm_engine.runner.decode_forward, "graphs", None), "no decode CUDA graph captured"
            diff = self.max_logits_diff(llm, model, prompts)
            assert diff < self.CUDA_LOGITS_ATOL, f"prompt logits on CUDA: max |diff| {diff:.2e}"
        finally:
            llm.shutdown()

    @staticmethod
    def max_logits_diff(llm: Any, model: Any, prompts: list[list[int]]) -> float:
        """Largest |ours - model's| over every position of every prompt (full-prompt logits, one pass)."""
        ours = llm.llm_engine.prompt_logits(prompts)
        return max((got.float().cpu() - hf_logits(model, p)).abs().max().item() for got, p in zip(ours, prompts))

    def check_preemption(self, checkpoint: TinyCheckpoint, seed: int = 16, oracle: Any = None) -> None:
        """Four prompts that fit the KV pool alone but not together: greedy equals transformers through
        preemption and recompute, and preemption really happened. ``oracle``: the transformers model to compare
        with (the checkpoint's by default)."""
        block_size = 16
        prompts = self.prompts((40, 38, 36, 34), seed=seed)
        blocks_needed = [-(-(len(p) + self.NEW_TOKENS) // block_size) for p in prompts]
        num_kv_blocks = max(blocks_needed) + 2  # every request fits alone, the batch does not
        assert sum(blocks_needed) > num_kv_blocks
        want = self.oracle_greedy(checkpoint.model if oracle is None else oracle, prompts)
        llm = self.llm(checkpoint, block_size=block_size, num_kv_blocks=num_kv_blocks)
        assert self.greedy(llm, prompts) == want
        assert llm.llm_engine.stats.preemptions > 0
