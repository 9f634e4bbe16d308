"""Fixtures for the Qwen tests: tiny random Qwen checkpoints (built once per session), the engine helpers the
oracle tests share, and the committed chat templates (tests/data) with a tokenizer that knows their tokens."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from cvllm.testing.checkpoints import TOKENIZER_VOCAB_SIZE, make_checkpoint
from cvllm.testing.threads import one_torch_thread as _one_torch_thread
from cvllm.testing.tokenizer import build_tiny_tokenizer, tokenizer_config

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(slots=True)
class TinyCheckpoint:
    path: Path
    model: Any  # the transformers model whose weights the files hold (fp32, eval mode)


CheckpointFactory = Callable[..., TinyCheckpoint]


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``qwen_checkpoint(arch, spelling=..., shards=..., fused_experts=..., **config_overrides)``, cached."""
    built: dict[str, TinyCheckpoint] = {}

    def build(arch: str, **kwargs: Any) -> TinyCheckpoint:
        key = json.dumps([arch, kwargs], sort_keys=True)
        if key not in built:
            path = tmp_path_factory.mktemp(f"{arch}-{len(built)}")
            built[key] = TinyCheckpoint(path, make_checkpoint(path, arch, **kwargs))
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


# ---- the committed chat templates and a tokenizer for them ----

DATA = Path(__file__).parent / "data"

CHATML = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>"}

# DeepSeek revised the distills' tokenizer_config.json after the first release (the copy in tests/data) so that
# the generation prompt opens the reasoning block; that one string is the whole change (checked against the
# template llama.cpp's converter printed for DeepSeek-R1-Distill-Llama-8B, whose first release was identical).
R1_FIRST_RELEASE_PROMPT = "{{'<｜Assistant｜>'}}{% endif %}"
R1_REVISED_PROMPT = "{{'<｜Assistant｜><think>\\n'}}{% endif %}"

# Added to the tiny vocabulary (which has ChatML's tokens already) with the "special" flag the published
# tokenizer.json files give them: the reasoning tags and DeepSeek's role markers are not special, so decoding
# with skip_special_tokens keeps them as text, and the reasoning parser sees the tags.
ADDED_TOKENS = {"<｜begin▁of▁sentence｜>": True, "<｜end▁of▁sentence｜>": True, "<｜User｜>": False,
                "<｜Assistant｜>": False, "<think>": False, "</think>": False}


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    source: str
    specials: dict[str, str]        # the special tokens its tokenizer_config.json names
    opens: str                      # what the generation prompt ends with (thinking left at the default)


def template_file(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


def r1_revised_template() -> str:
    """The distills' template as DeepSeek revised it, built from the first release in tests/data."""
    first = template_file("deepseek-r1-distill-qwen-32b")
    assert first.count(R1_FIRST_RELEASE_PROMPT) == 1 and first.endswith(R1_FIRST_RELEASE_PROMPT)
    return first.replace(R1_FIRST_RELEASE_PROMPT, R1_REVISED_PROMPT)


@pytest.fixture(scope="session")
def qwen_chat_templates() -> dict[str, ChatTemplate]:
    """name -> the template, its special tokens and how its generation prompt ends."""
    return {
        "qwen3-0.6b": ChatTemplate(template_file("qwen3-0.6b"), CHATML, "<|im_start|>assistant\n"),
        "qwq-32b": ChatTemplate(template_file("qwq-32b"), CHATML, "<|im_start|>assistant\n<think>\n"),
        "deepseek-r1-distill-qwen-32b": ChatTemplate(r1_revised_template(), DEEPSEEK, "<｜Assistant｜><think>\n"),
        "deepseek-r1-distill-qwen-32b-first-release": ChatTemplate(
            template_file("deepseek-r1-distill-qwen-32b"), DEEPSEEK, "<｜Assistant｜>"),
    }


def write_chat_tokenizer(dir: Path, template: ChatTemplate | None = None) -> Path:
    """tokenizer.json: the tiny tokenizer plus ADDED_TOKENS; with a template, also the tokenizer_config.json a
    hub checkpoint ships (its special tokens and the template). Returns the tokenizer.json path."""
    dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    for content, special in ADDED_TOKENS.items():
        tokenizer.add_tokens([AddedToken(content, special=special, normalized=False)])
    tokenizer.save(str(dir / "tokenizer.json"))
    if template is not None:
        config = {**tokenizer_config(), "bos_token": None, **template.specials, "chat_template": template.source}
        (dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return dir / "tokenizer.json"


@pytest.fixture(scope="session")
def chat_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer.json with ChatML's and DeepSeek's control tokens and the reasoning tags."""
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat-tokenizer"))


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory,
                       qwen_chat_templates: dict[str, ChatTemplate]) -> Callable[[str], Path]:
    """``chat_tokenizer_dir(name)``: a folder with that tokenizer.json and the tokenizer_config.json that ships
    the named template (written once per name)."""
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            written[name] = tmp_path_factory.mktemp(f"chat-{name}")
            write_chat_tokenizer(written[name], qwen_chat_templates[name])
        return written[name]

    return get
