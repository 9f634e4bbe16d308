"""Fixtures for the Qwen tests: tiny random Qwen checkpoints (built once per session), the oracle tests' harness
(cvllm.testing's), and the committed chat templates (tests/data) with a tokenizer that knows their tokens."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import AddedToken

from cvllm.testing import CheckpointFactory, checkpoint_factory
from cvllm.testing.fixtures import harness, one_torch_thread  # noqa: F401 (the fixtures, found here by pytest)
from cvllm.testing.tokenizer import build_tiny_tokenizer, tokenizer_config

# Everything the tests load is on disk; nothing may reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``qwen_checkpoint(arch, spelling=..., shards=..., fused_experts=..., **config_overrides)``, cached."""
    return checkpoint_factory(tmp_path_factory)



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
