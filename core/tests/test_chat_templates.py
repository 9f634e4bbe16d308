"""Chat templates render exactly as transformers renders them.

Real templates (tests/data/chat_templates, each with a .source.md) are rendered by ``render_chat`` and by
``cvllm.tokenizer.Tokenizer.apply_chat_template``, and compared character for character with transformers'
``PreTrainedTokenizerFast.apply_chat_template(tokenize=False)`` on the same tiny tokenizer and special tokens.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizersTokenizer
from transformers import PreTrainedTokenizerFast

from cvllm.chat_template import ChatTemplateError, compile_template, flatten_content, render_chat
from cvllm.testing import write_tiny_tokenizer
from cvllm.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data" / "chat_templates"

CHATML = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
DEEPSEEK = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
            "pad_token": "<｜end▁of▁sentence｜>"}
GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>"}

# template file → the special tokens its model's tokenizer has
TEMPLATES = {
    "qwen2.5-instruct": CHATML,
    "qwen3-0.6b": CHATML,
    "qwq-32b": CHATML,
    "smollm2-135m-instruct": CHATML,
    "deepseek-r1-distill-qwen-32b": DEEPSEEK,
    "llama-3.2-3b-instruct": LLAMA3,
    "gemma-2-2b-it": GEMMA,
    "mistral-nemo-instruct-2407": MISTRAL,
}
WITH_TOOLS = ("qwen2.5-instruct", "qwen3-0.6b", "qwq-32b", "llama-3.2-3b-instruct", "mistral-nemo-instruct-2407")
ALTERNATING_ONLY = ("gemma-2-2b-it",)  # no system role

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — °C, “quoted”.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time.", "parameters": {"type": "object", "properties": {}}}}


def _parts(*texts: str) -> list[dict[str, str]]:
    return [{"type": "text", "text": t} for t in texts]


def _as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The API's content rule, written out independently: parts joined with "\\n", null or missing → ""."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        out.append({**m, "content": content or ""})
    return out


SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hello there!"}],
    "system_multi_turn": [SYSTEM, {"role": "user", "content": "What is 2+2?"},
                          {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    "unicode_and_markup": [{"role": "user", "content": "Grüße 🙂 \"quotes\" <b>tags</b> & {{ braces }}\n  spaced  "}],
    "multi_part": [{"role": "system", "content": _parts("Be kind.", "Be brief.")},
                   {"role": "user", "content": _parts("First line.", "Second line.")},
                   {"role": "assistant", "content": _parts("Noted.")},
                   {"role": "user", "content": _parts("Go on.")}],
    "null_fields": [{"role": "user", "content": "Hi", "name": None},
                    {"role": "assistant", "content": "Hello!", "tool_calls": None},
                    {"role": "user", "content": "Bye"}],
}
TOOL_CALL_ID = "call12345"  # Mistral insists on 9 characters
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": TOOL_CALL_ID, "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": TOOL_CALL_ID, "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(path)
    return path / "tokenizer.json"


def _source(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


def _reference(tokenizer_file: Path, source: str, messages: list, specials: dict[str, str], **kwargs: Any) -> str:
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **specials)
    assert hf.special_tokens_map == specials  # the template sees exactly these tokens, and no others
    return hf.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)


def _ours(tokenizer_file: Path, source: str, messages: list, specials: dict[str, str], **kwargs: Any) -> str:
    """Render through render_chat and through Tokenizer.apply_chat_template; they must agree."""
    kwargs.setdefault("add_generation_prompt", False)  # transformers' default, so both sides get the same
    direct = render_chat(source, messages, special_tokens=specials, **kwargs)
    tok = Tokenizer(HFTokenizersTokenizer.from_file(str(tokenizer_file)), chat_template=source, **specials)
    assert tok.apply_chat_template(messages, **kwargs) == direct
    return direct


def _cases() -> list[tuple[str, str, list, dict[str, Any]]]:
    cases = []
    for name in TEMPLATES:
        for conv_name, conv in CONVERSATIONS.items():
            if name in ALTERNATING_ONLY and conv[0]["role"] == "system":
                conv = conv[1:]
            for prompt in (True, False):
                cases.append((name, f"{conv_name}-prompt={prompt}", conv, {"add_generation_prompt": prompt}))
        cases.append((name, "continue_final", [{"role": "user", "content": "Capital of France?"},
                                               {"role": "assistant", "content": "The capital is"}],
                      {"continue_final_message": True}))
        # A trailing space that a trimming template (Gemma, Llama) removes: the cut must still be right.
        cases.append((name, "continue_final_trailing_space", [{"role": "user", "content": "Count to three."},
                                                              {"role": "assistant", "content": "One, two, "}],
                      {"continue_final_message": True}))
        if name in WITH_TOOLS:
            cases.append((name, "tools_offered", CONVERSATIONS["single_user"],
                          {"tools": [WEATHER_TOOL, TIME_TOOL], "add_generation_prompt": True}))
            cases.append((name, "tool_round_trip", TOOL_CONVERSATION,
                          {"tools": [WEATHER_TOOL], "add_generation_prompt": True}))
    llama = ("llama-3.2-3b-instruct", {"date_string": "26 Jul 2024"})
    cases += [
        (llama[0], "date_string", CONVERSATIONS["system_multi_turn"], {**llama[1], "add_generation_prompt": True}),
        (llama[0], "tools_in_system", CONVERSATIONS["system_multi_turn"],
         {**llama[1], "tools": [WEATHER_TOOL], "tools_in_user_message": False, "add_generation_prompt": True}),
    ]
    thinking = [SYSTEM, {"role": "user", "content": "Why is the sky blue?"},
                {"role": "assistant", "content": "<think>\nRayleigh.\n</think>\n\nScattering."},
                {"role": "user", "content": "And sunsets?"},
                {"role": "assistant", "content": "Longer path.", "reasoning_content": "Think about the angle."}]
    for name in ("qwen3-0.6b", "qwq-32b", "deepseek-r1-distill-qwen-32b"):
        cases.append((name, "think_history", thinking, {}))
        cases.append((name, "think_history_then_prompt", thinking[:4], {"add_generation_prompt": True}))
    for enable in (True, False):
        cases.append(("qwen3-0.6b", f"enable_thinking={enable}", CONVERSATIONS["system_multi_turn"],
                      {"add_generation_prompt": True, "enable_thinking": enable}))
    # "reasoning" is aliased to reasoning_content, the field Qwen3 reads
    cases.append(("qwen3-0.6b", "reasoning_alias", [{"role": "user", "content": "Hi"},
                                                     {"role": "assistant", "content": "Hello.", "reasoning": "Greet."}],
                  {}))
    cases.append(("qwen3-0.6b", "continue_reasoning", [{"role": "user", "content": "2+2?"},
                                                        {"role": "assistant", "content": "",
                                                         "reasoning_content": "Adding two and"}],
                  {"continue_final_message": "reasoning_content"}))
    return cases


CASES = _cases()


@pytest.mark.parametrize(("name", "case", "messages", "kwargs"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_real_template_matches_transformers(tokenizer_file: Path, name: str, case: str, messages: list,
                                            kwargs: dict[str, Any]) -> None:
    source, specials = _source(name), TEMPLATES[name]
    before = copy.deepcopy(messages)
    expected = _reference(tokenizer_file, source, _as_text(messages), specials, **kwargs)
    got = _ours(tokenizer_file, source, messages, specials, **kwargs)
    assert got == expected
    assert messages == before  # flattening, None-dropping and continue tagging work on copies


def test_every_template_file_has_a_source_note() -> None:
    names = {p.stem for p in DATA.glob("*.jinja")}
    assert names == set(TEMPLATES)
    for name in names:
        note = (DATA / f"{name}.source.md").read_text(encoding="utf-8")
        assert "License" in note and "sha256" in note


def test_known_renders(tokenizer_file: Path) -> None:
    # Anchors that do not depend on transformers: the generation prompts the models are trained on.
    chat = [{"role": "user", "content": "Hi"}]
    qwen3 = _ours(tokenizer_file, _source("qwen3-0.6b"), chat, CHATML, add_generation_prompt=True,
                  enable_thinking=False)
    assert qwen3 == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    smol = _ours(tokenizer_file, _source("smollm2-135m-instruct"), chat, CHATML, add_generation_prompt=True)
    assert smol == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    cont = _ours(tokenizer_file, _source("gemma-2-2b-it"), [*chat, {"role": "assistant", "content": "Hey, "}],
                 GEMMA, continue_final_message=True)
    assert cont == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHey,"


# ---- errors ----

@pytest.mark.parametrize(("name", "messages", "message"), [
    ("gemma-2-2b-it", [SYSTEM, {"role": "user", "content": "Hi"}], "System role not supported"),
    ("gemma-2-2b-it", [{"role": "assistant", "content": "Hi"}],
     "Conversation roles must alternate user/assistant/user/assistant/..."),
    ("mistral-nemo-instruct-2407", [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
     "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."),
])
def test_raise_exception_carries_the_templates_message(tokenizer_file: Path, name: str, messages: list,
                                                       message: str) -> None:
    with pytest.raises(jinja2.TemplateError, match="^" + message.replace(".", r"\.") + "$"):
        _reference(tokenizer_file, _source(name), messages, TEMPLATES[name])
    with pytest.raises(ChatTemplateError) as info:
        render_chat(_source(name), messages, special_tokens=TEMPLATES[name])
    assert str(info.value) == message


@pytest.mark.parametrize("source", ["{% if %}x{% endif %}", "{% for m in messages %}", "{% frobnicate %}",
                                    "{{ messages | no_such_filter }}"])
def test_template_that_does_not_compile(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat(source, [{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("source", [
    "{{ messages.append(1) }}",                               # the sandbox is immutable
    "{% set ns = namespace(_hidden=1) %}",                    # no underscore names on namespaces
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
    "{{ 1 + messages[0].content }}",                          # a Python TypeError inside the template
    "{{ messages[5].content.upper() }}",                      # undefined
])
def test_render_failures_are_chat_template_errors(tokenizer_file: Path, source: str) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(Exception):  # noqa: B017 - transformers fails too (SecurityError, TypeError, UndefinedError)
        _reference(tokenizer_file, source, messages, CHATML)
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render_chat(source, messages)


def test_null_content_renders_as_empty_string(tokenizer_file: Path) -> None:
    # transformers drops content=None, and Qwen3's template then fails on the tool-call turn; the API (like
    # vLLM) sends "" instead, so ours renders what transformers renders for content "".
    source, kwargs = _source("qwen3-0.6b"), {"tools": [WEATHER_TOOL], "add_generation_prompt": True}
    with pytest.raises(jinja2.UndefinedError):
        _reference(tokenizer_file, source, TOOL_CONVERSATION, CHATML, **kwargs)
    expected = _reference(tokenizer_file, source, _as_text(TOOL_CONVERSATION), CHATML, **kwargs)
    assert render_chat(source, TOOL_CONVERSATION, special_tokens=CHATML, **kwargs) == expected
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in expected
    no_key = [{"role": "user"}, {"role": "assistant", "content": None}]
    assert flatten_content(no_key) == [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]


def test_non_text_part_is_refused_naming_its_type() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                             {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    with pytest.raises(ValueError, match="'image_url'"):
        flatten_content(messages)
    with pytest.raises(ChatTemplateError, match="'image_url'"):
        render_chat(_source("qwen2.5-instruct"), messages)
    assert flatten_content([{"role": "user", "content": _parts("a", "b", "c")}]) == [{"role": "user",
                                                                                      "content": "a\nb\nc"}]


def test_input_errors(tokenizer_file: Path) -> None:
    source = _source("qwen2.5-instruct")
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        render_chat(source, [])
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "He"}]
    with pytest.raises(ChatTemplateError, match="not compatible"):
        render_chat(source, chat, continue_final_message=True)  # add_generation_prompt defaults to True
    with pytest.raises(ValueError, match="not compatible"):
        _reference(tokenizer_file, source, chat, CHATML, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(ChatTemplateError, match='has no "reasoning_content" to continue'):
        render_chat(_source("qwen3-0.6b"), chat, add_generation_prompt=False,
                    continue_final_message="reasoning_content")
    with pytest.raises(ChatTemplateError, match='"thinking" but this is not an accepted field'):
        render_chat(source, [*chat[:1], {**chat[1], "thinking": "Hmm"}], add_generation_prompt=False,
                    continue_final_message="thinking")
    with pytest.raises(ChatTemplateError, match="'messages'"):
        render_chat(source, chat, **{"messages": []})  # chat_template_kwargs cannot replace the chat
    with pytest.raises(ChatTemplateError, match="Tools"):
        render_chat(source, chat, tools=["get_weather"])


# ---- the environment ----

def test_tojson_options_match_json_dumps(tokenizer_file: Path) -> None:
    source = ("{% set d = messages[0].data %}{{ d | tojson }}\n{{ d | tojson(indent=2) }}\n"
              "{{ d | tojson(separators=(',', ':')) }}\n{{ d | tojson(sort_keys=true) }}\n"
              "{{ d | tojson(ensure_ascii=true) }}\n{{ d | tojson(indent=4, sort_keys=true) }}")
    data = {"z": [1, 2.5, None, True], "a": "é <b>&'\"", "m": {"k": "🙂"}}
    messages = [{"role": "user", "content": "x", "data": data}]
    got = render_chat(source, messages)
    assert got.split("\n")[0] == json.dumps(data, ensure_ascii=False)  # no HTML escaping, unlike jinja's tojson
    assert got == "\n".join([json.dumps(data, ensure_ascii=False), json.dumps(data, ensure_ascii=False, indent=2),
                             json.dumps(data, ensure_ascii=False, separators=(",", ":")),
                             json.dumps(data, ensure_ascii=False, sort_keys=True), json.dumps(data),
                             json.dumps(data, ensure_ascii=False, indent=4, sort_keys=True)])
    assert got == _reference(tokenizer_file, source, messages, CHATML)


def test_strftime_now() -> None:
    before = datetime.now().strftime("%d %b %Y|%Y-%m-%d")
    got = render_chat("{{ strftime_now('%d %b %Y|%Y-%m-%d') }}", [{"role": "user", "content": "x"}])
    after = datetime.now().strftime("%d %b %Y|%Y-%m-%d")
    assert got in (before, after)
    llama = render_chat(_source("llama-3.2-3b-instruct"), [{"role": "user", "content": "x"}])
    assert f"Today Date: {got.split('|')[0]}\n" in llama or f"Today Date: {after.split('|')[0]}\n" in llama


def test_environment_features_match_transformers(tokenizer_file: Path) -> None:
    source = (
        "{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}[{{ m.content }}]{% endgeneration %}"
        "{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
        "{% set d = dict(a=1) %}{{ d | tojson }} {{ dict.fromkeys(['x'], 0) | tojson }}\n"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ bos_token is defined }}|{{ eos_token }}|"
        "{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ custom | default('unset') }}")
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    got = _ours(tokenizer_file, source, messages, CHATML)
    # trim_blocks: the newline after {% endif %} goes, the one after {{ ... }} stays
    assert got == "a[b]{\"a\": 1} {\"x\": 0}\n2|False|<|im_end|>|None|None|False|unset"
    assert got == _reference(tokenizer_file, source, messages, CHATML)
    with_kwargs = dict(custom="set", eos_token="<override>", documents=[{"title": "T", "text": "body"}],
                       add_generation_prompt=True)
    assert _ours(tokenizer_file, source, messages, CHATML, **with_kwargs) == _reference(
        tokenizer_file, source, messages, CHATML, **with_kwargs)


def test_tokenizer_from_dir_matches_transformers(tokenizer_file: Path) -> None:
    # The real loading path: tokenizer_config.json's template and special tokens (bos unset → undefined).
    ours = Tokenizer.from_dir(tokenizer_file.parent)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_file.parent))
    messages = CONVERSATIONS["system_multi_turn"]
    for prompt in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=prompt) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt)
    probe = "{{ bos_token is defined }} {{ eos_token }} {{ pad_token }}"
    assert ours.apply_chat_template(messages, chat_template=probe) == "False <|im_end|> <|endoftext|>"


def test_compile_is_cached() -> None:
    assert compile_template(_source("qwq-32b")) is compile_template(_source("qwq-32b"))


def test_a_template_that_loops_over_content_gets_the_parts():
    """vLLM's content-format detection: a template with ``for part in message['content']`` (directly, through a
    variable, or a filter) renders multi-part content itself; others get the parts joined with newlines."""
    from cvllm.chat_template import render_chat, wants_content_parts

    looping = ("{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}")
    through_variable = ("{% for m in messages %}{% set c = m.content %}{% for p in c | list %}[{{ p.text }}]"
                        "{% endfor %}{% endfor %}")
    plain = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert wants_content_parts(looping) and wants_content_parts(through_variable) and not wants_content_parts(plain)
    assert render_chat(looping, parts, add_generation_prompt=False) == "[a][b]"
    assert render_chat(through_variable, parts, add_generation_prompt=False) == "[a][b]"
    assert render_chat(plain, parts, add_generation_prompt=False) == "[a\nb]"
    string = [{"role": "user", "content": "ab"}]   # a string stays a string either way
    assert render_chat(plain, string, add_generation_prompt=False) == "[ab]"
