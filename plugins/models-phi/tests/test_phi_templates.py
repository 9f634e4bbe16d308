"""Phi's chat template renders exactly as transformers 5 renders it.

The template (tests/data, with its .source.md) is rendered by cvllm's ``render_chat`` and by
``cvllm.tokenizer.Tokenizer.apply_chat_template``, and compared character for character with transformers'
``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)`` on the tiny test tokenizer with Phi's control
tokens added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cvllm.testing.chat_templates import ChatTemplates, check_source_notes, template_cases

DATA = Path(__file__).parent / "data"

# template -> the special tokens its model's tokenizer names (Phi-3.5's template reads only eos_token)
TEMPLATES = {"phi-3.5-mini-instruct": {"bos_token": "<s>", "eos_token": "<|endoftext|>",
                                       "pad_token": "<|endoftext|>"}}
CONTROL_TOKENS = ("<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # <|endoftext|>: in the vocab

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello there!"}],
    "system_multi_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    "empty_system": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}],  # no system turn
    "tool_turn_skipped": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Checking."},
                          {"role": "tool", "content": "{\"sky\": \"clear\"}"}, {"role": "user", "content": "So?"}],
    "unicode_and_markup": [{"role": "user", "content": "Grüße 🙂 <b>tags</b> & {{ braces }}\n  spaced  "}],
}


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplates:
    return ChatTemplates(DATA, TEMPLATES, CONTROL_TOKENS, tmp_path_factory.mktemp("phi-chat-tokenizer"))


CONTINUE_FINAL = [{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "The capital is"}]


CASES = template_cases(TEMPLATES, CONVERSATIONS, CONTINUE_FINAL)


@pytest.mark.parametrize(("name", "case", "messages", "kwargs"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_template_renders_as_transformers(chats: ChatTemplates, name: str, case: str, messages: list,
                                          kwargs: dict[str, Any]) -> None:
    assert chats.ours(name, messages, **kwargs) == chats.reference(name, messages, **kwargs)


def test_known_template_renders(chats: ChatTemplates) -> None:
    # Anchors that do not depend on transformers: the prompt the model is trained on, and the closed text.
    chat = [SYSTEM, {"role": "user", "content": "Hi"}]
    assert chats.ours("phi-3.5-mini-instruct", chat, add_generation_prompt=True) == (
        "<|system|>\nYou are terse. Answer in one line.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n")
    assert chats.ours("phi-3.5-mini-instruct", chat[1:], add_generation_prompt=False) == (
        "<|user|>\nHi<|end|>\n<|endoftext|>")


def test_template_data_files_are_the_verbatim_copies_their_notes_describe() -> None:
    check_source_notes(DATA, TEMPLATES)
