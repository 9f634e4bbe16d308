"""The Qwen-family chat templates render exactly as transformers 5.24 renders them, with thinking on and off,
and the server's reasoning-parser detection picks the right parser for each.

Templates (tests/data, each with a .source.md) are rendered by cvllm's ``render_chat`` and by
``cvllm.tokenizer.Tokenizer.apply_chat_template``, and compared character for character with transformers'
``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)`` on the tiny test tokenizer with the templates'
control tokens and reasoning tags added (conftest.py).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizersTokenizer
from transformers import PreTrainedTokenizerFast

from cvllm.chat_template import render_chat
from cvllm.server.reasoning import detect
from cvllm.tokenizer import Tokenizer

# the templates in conftest.py's qwen_chat_templates (names here: parametrization happens before fixtures exist)
TEMPLATE_NAMES = ("qwen3-0.6b", "qwq-32b", "deepseek-r1-distill-qwen-32b",
                  "deepseek-r1-distill-qwen-32b-first-release")
Templates = dict[str, tuple[str, dict[str, str], str]]

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello there!"}],
    "system_multi_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    # earlier reasoning, inline and as reasoning_content: the templates drop or keep it in their own ways
    "think_history": [SYSTEM, {"role": "user", "content": "Why is the sky blue?"},
                      {"role": "assistant", "content": "<think>\nRayleigh.\n</think>\n\nScattering."},
                      {"role": "user", "content": "And sunsets?"}],
}


@pytest.fixture(scope="module")
def tokenizer_file(chat_tokenizer_file: Path) -> Path:
    return chat_tokenizer_file


@pytest.fixture(scope="module")
def templates(qwen_chat_templates) -> Templates:
    """name -> (template source, special tokens, what the generation prompt ends with)"""
    return {name: (t.source, t.specials, t.opens) for name, t in qwen_chat_templates.items()}


def test_every_template_is_tested(templates: Templates) -> None:
    assert sorted(templates) == sorted(TEMPLATE_NAMES)


def _reference(tokenizer_file: Path, source: str, messages: list, specials: dict[str, str], **kwargs: Any) -> str:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **specials)
    assert hf.special_tokens_map == specials  # the template sees exactly these tokens, and no others
    return hf.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)


def _tokenizer(tokenizer_file: Path, source: str, specials: dict[str, str]) -> Tokenizer:
    return Tokenizer(HFTokenizersTokenizer.from_file(str(tokenizer_file)), chat_template=source, **specials)


def _ours(tokenizer_file: Path, source: str, messages: list, specials: dict[str, str], **kwargs: Any) -> str:
    """Render through render_chat and through Tokenizer.apply_chat_template; they must agree."""
    direct = render_chat(source, messages, special_tokens=specials, **kwargs)
    assert _tokenizer(tokenizer_file, source, specials).apply_chat_template(messages, **kwargs) == direct
    return direct


def _cases() -> list[tuple[str, str, dict[str, Any]]]:
    cases = []
    for name in TEMPLATE_NAMES:
        for conversation in CONVERSATIONS:
            cases.append((name, conversation, {"add_generation_prompt": False}))
            for thinking in (None, True, False):  # None: the template's default
                kwargs: dict[str, Any] = {"add_generation_prompt": True}
                if thinking is not None:
                    kwargs["enable_thinking"] = thinking
                cases.append((name, conversation, kwargs))
    return cases


CASES = _cases()


@pytest.mark.parametrize(("name", "conversation", "kwargs"), CASES,
                         ids=[f"{n}-{c}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, c, kw in CASES])
def test_renders_as_transformers(tokenizer_file: Path, templates: Templates, name: str, conversation: str,
                                 kwargs: dict[str, Any]) -> None:
    source, specials, _ = templates[name]
    messages = CONVERSATIONS[conversation]
    expected = _reference(tokenizer_file, source, messages, specials, **kwargs)
    assert _ours(tokenizer_file, source, messages, specials, **kwargs) == expected


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
@pytest.mark.parametrize("thinking", [None, True, False])
def test_generation_prompt(tokenizer_file: Path, templates: Templates, name: str, thinking: bool | None) -> None:
    source, specials, opens = templates[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    prompt = _ours(tokenizer_file, source, CONVERSATIONS["single_user"], specials, add_generation_prompt=True,
                   **kwargs)
    if name == "qwen3-0.6b" and thinking is False:
        # thinking off: Qwen3's template writes an empty reasoning block for the model to skip
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    else:  # QwQ and the distills ignore enable_thinking
        assert prompt.endswith(opens)


@pytest.mark.parametrize(("name", "parser"), [
    ("qwen3-0.6b", "think"),                      # the model writes <think> itself, when it thinks
    ("qwq-32b", "deepseek_r1"),                   # the prompt opens <think>: output is reasoning until </think>
    ("deepseek-r1-distill-qwen-32b", "deepseek_r1"),
    # first release: no <think> in the template, only </think> stripped from history; the model opens it itself
    ("deepseek-r1-distill-qwen-32b-first-release", "think"),
])
def test_reasoning_parser_detection(tokenizer_file: Path, templates: Templates, name: str, parser: str) -> None:
    source, specials, _ = templates[name]
    tokenizer = _tokenizer(tokenizer_file, source, specials)
    # what the server does when no --reasoning-parser is given
    render = lambda: tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],  # noqa: E731
                                                   add_generation_prompt=True, chat_template=source)
    assert detect(source, render) == parser


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwq-32b", "deepseek-r1-distill-qwen-32b"])
def test_data_files_are_the_verbatim_copies_their_notes_describe(name: str) -> None:
    data = Path(__file__).parent / "data"
    note = (data / f"{name}.source.md").read_text(encoding="utf-8")
    assert "License" in note
    digest = re.search(r"sha256 `([0-9a-f]{64})`", note)
    assert digest, f"{name}.source.md gives no sha256"
    assert hashlib.sha256((data / f"{name}.jinja").read_bytes()).hexdigest() == digest[1]
