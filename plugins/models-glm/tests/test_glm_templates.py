"""GLM-4's chat templates render exactly as transformers 5 renders them.

Templates (tests/data, each with a .source.md) are rendered by cvllm's ``render_chat`` and by
``cvllm.tokenizer.Tokenizer.apply_chat_template``, and compared character for character with transformers'
``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)`` on the tiny test tokenizer with GLM's control
tokens added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cvllm.testing.chat_templates import ChatTemplates, check_source_notes, template_cases

DATA = Path(__file__).parent / "data"

GLM = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}  # neither template reads a special token
TEMPLATES = {"glm-4-9b-chat": GLM, "glm-4-9b-0414": GLM}
CONTROL_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CALL = {"role": "assistant", "metadata": "get_weather", "content": '{"city": "Paris"}'}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello there!"}],
    "system_multi_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    "empty_content_skipped": [{"role": "system", "content": ""}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": ""}, {"role": "user", "content": "Still there?"}],
    # a call is an assistant turn with metadata (the function's name), its result an observation turn
    "tool_round_trip": [{"role": "user", "content": "Weather in Paris?"}, CALL,
                        {"role": "observation", "content": '{"sky": "clear"}'}],
    "late_system_and_unknown_role": [{"role": "user", "content": "Hi"}, {"role": "tool", "content": "ignored?"},
                                     SYSTEM, {"role": "user", "content": "Bye"}],
    "unicode_and_markup": [{"role": "user", "content": "Grüße 🙂 <b>tags</b> & {{ braces }}\n  spaced  中文 "}],
}
CONTINUE_FINAL = [{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "The capital is"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather now, in a city. 天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplates:
    return ChatTemplates(DATA, TEMPLATES, CONTROL_TOKENS, tmp_path_factory.mktemp("glm-chat-tokenizer"))


CASES = template_cases(TEMPLATES, CONVERSATIONS, CONTINUE_FINAL)


@pytest.mark.parametrize(("name", "case", "messages", "kwargs"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_template_renders_as_transformers(chats: ChatTemplates, name: str, case: str, messages: list,
                                          kwargs: dict[str, Any]) -> None:
    assert chats.ours(name, messages, **kwargs) == chats.reference(name, messages, **kwargs)


def test_0414_tools_preamble_renders_as_transformers(chats: ChatTemplates) -> None:
    # GLM-4-0414 reads the request's tools (tojson with indent 4, non-ASCII kept)
    messages, kwargs = CONVERSATIONS["tool_round_trip"], {"add_generation_prompt": True, "tools": TOOLS}
    ours = chats.ours("glm-4-9b-0414", messages, **kwargs)
    assert ours == chats.reference("glm-4-9b-0414", messages, **kwargs)
    assert ours.startswith("[gMASK]<sop><|system|>\n# 可用工具\n\n## get_weather\n\n{\n    \"name\"") and "天气" in ours


def test_9b_chat_tools_carried_by_a_message_render_as_transformers(chats: ChatTemplates) -> None:
    # glm-4-9b-chat reads tools from a message's own "tools" key (its system message), not from the request
    messages = [{"role": "system", "content": "", "tools": TOOLS}, {"role": "user", "content": "Weather?"}]
    kwargs = {"add_generation_prompt": True}
    ours = chats.ours("glm-4-9b-chat", messages, **kwargs)
    assert ours == chats.reference("glm-4-9b-chat", messages, **kwargs)
    assert '## get_weather\n\n{\n    "name": "get_weather"' in ours


def test_known_templates_render(chats: ChatTemplates) -> None:
    # Anchors that do not depend on transformers: the prompts the models are trained on.
    chat = [SYSTEM, {"role": "user", "content": "Hi"}]
    expected = "[gMASK]<sop><|system|>\nYou are terse. Answer in one line.<|user|>\nHi<|assistant|>"
    assert chats.ours("glm-4-9b-chat", chat, add_generation_prompt=True) == expected
    assert chats.ours("glm-4-9b-0414", chat, add_generation_prompt=True) == expected
    assert chats.ours("glm-4-9b-0414", CONVERSATIONS["tool_round_trip"], add_generation_prompt=True) == (
        '[gMASK]<sop><|user|>\nWeather in Paris?<|assistant|>get_weather \n{"city": "Paris"}'
        '<|observation|>\n{"sky": "clear"}<|assistant|>')


def test_template_data_files_are_the_verbatim_copies_their_notes_describe() -> None:
    check_source_notes(DATA, TEMPLATES)
