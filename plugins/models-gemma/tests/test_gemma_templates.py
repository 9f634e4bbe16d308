"""Gemma's chat templates render exactly as transformers 5 renders them.

Templates (tests/data, each with a .source.md) are rendered by cvllm's ``render_chat`` and by
``cvllm.tokenizer.Tokenizer.apply_chat_template``, and compared character for character with transformers'
``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)`` on the tiny test tokenizer with Gemma's control
tokens added.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jinja2
import pytest

from cvllm.chat_template import ChatTemplateError, render_chat
from cvllm.testing.chat_templates import ChatTemplates, check_source_notes, template_cases

DATA = Path(__file__).parent / "data"

GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
TEMPLATES = {"gemma-2-2b-it": GEMMA, "gemma-3-it": GEMMA}  # template -> the special tokens its tokenizer names
NO_SYSTEM_ROLE = ("gemma-2-2b-it",)  # raises on a system message; Gemma 3 folds it into the first user turn
CONTROL_TOKENS = ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>")

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello there!"}],
    "system_multi_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    "trimmed_content": [{"role": "user", "content": "\n  Grüße 🙂 <b>tags</b> & {{ braces }}  \n"},
                        {"role": "assistant", "content": " Hi! \n"}, {"role": "user", "content": "  Bye"}],
}
ALTERNATION = "Conversation roles must alternate user/assistant/user/assistant/..."


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplates:
    return ChatTemplates(DATA, TEMPLATES, CONTROL_TOKENS, tmp_path_factory.mktemp("gemma-chat-tokenizer"))


# a trailing space the template trims away: the cut after the final message must still be right
CONTINUE_FINAL = [{"role": "user", "content": "Count to three."},
                  {"role": "assistant", "content": "One, two, "}]


CASES = template_cases(TEMPLATES, CONVERSATIONS, CONTINUE_FINAL, NO_SYSTEM_ROLE)


@pytest.mark.parametrize(("name", "case", "messages", "kwargs"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_template_renders_as_transformers(chats: ChatTemplates, name: str, case: str, messages: list,
                                          kwargs: dict[str, Any]) -> None:
    assert chats.ours(name, messages, **kwargs) == chats.reference(name, messages, **kwargs)


def test_gemma3_multi_part_content_renders_as_transformers(chats: ChatTemplates) -> None:
    # Gemma 3's template loops over content parts (it trims and concatenates them): it gets the parts, as from
    # transformers, not the API's newline-joined string that templates without such a loop get
    messages = [{"role": "user", "content": [{"type": "text", "text": "First line."},
                                             {"type": "text", "text": "Second line."}]}]
    kwargs = {"add_generation_prompt": True}
    assert chats.ours("gemma-3-it", messages, **kwargs) == chats.reference(
        "gemma-3-it", messages, **kwargs)


def test_known_template_renders(chats: ChatTemplates) -> None:
    # Anchor that does not depend on transformers: Gemma 3 puts the system text at the top of the first user turn.
    chat = [SYSTEM, {"role": "user", "content": "Hi"}]
    assert chats.ours("gemma-3-it", chat, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nYou are terse. Answer in one line.\n\nHi<end_of_turn>\n<start_of_turn>model\n")


@pytest.mark.parametrize(("name", "messages", "message"), [
    ("gemma-2-2b-it", [SYSTEM, {"role": "user", "content": "Hi"}], "System role not supported"),
    ("gemma-2-2b-it", [{"role": "assistant", "content": "Hi"}], ALTERNATION),
    ("gemma-3-it", [SYSTEM, {"role": "assistant", "content": "Hi"}], ALTERNATION),
    ("gemma-3-it", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], ALTERNATION),
])
def test_template_raise_exception_carries_the_templates_message(chats: ChatTemplates, name: str, messages: list,
                                                                message: str) -> None:
    with pytest.raises(jinja2.TemplateError, match="^" + re.escape(message) + "$"):
        chats.reference(name, messages, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError) as info:
        render_chat(chats.source(name), messages, special_tokens=TEMPLATES[name])
    assert str(info.value) == message


def test_template_data_files_are_the_verbatim_copies_their_notes_describe() -> None:
    check_source_notes(DATA, TEMPLATES)
