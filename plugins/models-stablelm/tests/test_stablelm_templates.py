"""StableLM's chat template renders exactly as transformers 5 renders it.

The template (tests/data, with its .source.md) is rendered by cvllm's ``render_chat`` and by
``cvllm.tokenizer.Tokenizer.apply_chat_template``, and compared character for character with transformers'
``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)`` on the tiny test tokenizer (which already holds the
ChatML tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cvllm.testing.chat_templates import ChatTemplates, check_source_notes, template_cases

DATA = Path(__file__).parent / "data"

# stable-code-instruct-3b's tokenizer names these; the template reads none of them
TEMPLATES = {"stable-code-instruct-3b": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                         "pad_token": "<|endoftext|>"}}
CONTROL_TOKENS = ()  # <|endoftext|>, <|im_start|>, <|im_end|>: in the tiny vocabulary

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello there!"}],  # gets the default system message
    "system_multi_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    "only_system": [SYSTEM],  # no turn after it: nothing but the generation prompt
    "unicode_and_markup": [{"role": "user", "content": "Grüße 🙂 <b>tags</b> & {{ braces }}\n  spaced  "}],
}
CONTINUE_FINAL = [{"role": "user", "content": "Write fizzbuzz."},
                  {"role": "assistant", "content": "def fizzbuzz(n):"}]


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplates:
    return ChatTemplates(DATA, TEMPLATES, CONTROL_TOKENS, tmp_path_factory.mktemp("stablelm-chat-tokenizer"))


CASES = template_cases(TEMPLATES, CONVERSATIONS, CONTINUE_FINAL)


@pytest.mark.parametrize(("name", "case", "messages", "kwargs"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_template_renders_as_transformers(chats: ChatTemplates, name: str, case: str, messages: list,
                                          kwargs: dict[str, Any]) -> None:
    assert chats.ours(name, messages, **kwargs) == chats.reference(name, messages, **kwargs)


def test_known_template_renders(chats: ChatTemplates) -> None:
    # Anchor that does not depend on transformers: the default system message when the chat gives none.
    assert chats.ours("stable-code-instruct-3b", [{"role": "user", "content": "Hi"}], add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_template_data_files_are_the_verbatim_copies_their_notes_describe() -> None:
    check_source_notes(DATA, TEMPLATES)
