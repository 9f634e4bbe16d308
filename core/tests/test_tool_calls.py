"""Tool-call parsers (cvllm.server.tool_calls): calls taken out of the answer text whatever way it is cut into
pieces, text around them kept, what does not parse left as text; the parser a chat template calls for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cvllm.server.tool_calls import detect, tool_parser

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def run(name: str, text: str, piece: int) -> tuple[str, list[tuple[str, dict]]]:
    """The text fed ``piece`` characters at a time: (content, [(name, arguments)])."""
    parser = tool_parser(name)()
    content, calls = [], []
    for start in range(0, len(text), piece):
        out, new = parser.feed(text[start:start + piece])
        content.append(out)
        calls += new
    out, new = parser.finish()
    return "".join(content) + out, [(c.name, json.loads(c.arguments)) for c in calls + new]


PIECES = [1, 2, 5, 1000]


@pytest.mark.parametrize("piece", PIECES)
def test_hermes(piece):
    text = ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": "{\\"y\\": [2]}"}</tool_call> done <tool_')
    content, calls = run("hermes", text, piece)
    assert calls == [("f", {"x": 1}), ("g", {"y": [2]})]   # arguments given as an encoded string, decoded
    assert content == "Sure.\n\n done <tool_"              # a tag cut off at the end is text


@pytest.mark.parametrize("piece", PIECES)
def test_hermes_malformed_and_unclosed(piece):
    content, calls = run("hermes", "<tool_call>{oops}</tool_call>", piece)
    assert (content, calls) == ("<tool_call>{oops}</tool_call>", [])
    content, calls = run("hermes", 'a<tool_call>{"name": "f", "arguments": {}}', piece)   # EOS before the end tag
    assert (content, calls) == ("a", [("f", {})])


@pytest.mark.parametrize("piece", PIECES)
def test_mistral(piece):
    text = 'Calling.[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    assert run("mistral", text, piece) == ("Calling.", [("f", {"x": 1}), ("g", {})])
    assert run("mistral", "[TOOL_CALLS]not json", piece) == ("[TOOL_CALLS]not json", [])
    assert run("mistral", "no calls [TOOL", piece) == ("no calls [TOOL", [])


@pytest.mark.parametrize("piece", PIECES)
def test_llama3_json(piece):
    calls = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}'
    assert run("llama3_json", calls, piece) == ("", [("f", {"x": 1}), ("g", {})])
    assert run("llama3_json", "<|python_tag|>" + calls, piece) == ("", [("f", {"x": 1}), ("g", {})])
    assert run("llama3_json", "The answer is 4.", piece) == ("The answer is 4.", [])
    assert run("llama3_json", '{"not": "a call"}', piece) == ('{"not": "a call"}', [])


DEEPSEEK_CALL = ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
                 "<｜tool▁call▁end｜>")


@pytest.mark.parametrize("piece", PIECES)
def test_deepseek_v3(piece):
    calls = (DEEPSEEK_CALL.format(name="get_weather", arguments='{"city": "Paris"}') + "\n"
             + DEEPSEEK_CALL.format(name="f", arguments="{}"))
    text = f"Sure.<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>"
    assert run("deepseek_v3", text, piece) == ("Sure.", [("get_weather", {"city": "Paris"}), ("f", {})])
    broken = "<｜tool▁calls▁begin｜>" + DEEPSEEK_CALL.format(name="f", arguments="{oops") + "<｜tool▁calls▁end｜>"
    assert run("deepseek_v3", broken, piece) == (broken, [])


def test_a_plugin_adds_a_parser(add_plugin):
    from cvllm.hookspecs import hookimpl
    from cvllm.server.tool_calls import ParsedCall

    class Shouting:   # "CALL name" lines
        def feed(self, text):
            return "", []

        def finish(self):
            return "", [ParsedCall("shout", "{}")]

    class Plugin:
        @hookimpl
        def register_tool_parsers(self, register):
            register("shouting", Shouting)

    add_plugin(Plugin(), "shouting-parser")
    parser = tool_parser("shouting")()
    assert parser.finish()[1][0].name == "shout"


def test_call_ids_are_unique():
    parser = tool_parser("hermes")()
    _, calls = parser.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 2)
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize(("template", "parser"), [("qwen2.5-instruct", "hermes"), ("qwen3-0.6b", "hermes"),
                                                   ("llama-3.2-3b-instruct", "llama3_json"),
                                                   ("mistral-nemo-instruct-2407", "mistral"),
                                                   ("deepseek-r1-distill-qwen-32b", "deepseek_v3"),
                                                   ("gemma-2-2b-it", None), ("smollm2-135m-instruct", None)])
def test_detected_from_real_templates(template, parser):
    assert detect((TEMPLATES / f"{template}.jinja").read_text(encoding="utf-8")) == parser


def test_an_unknown_parser_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool-call parser 'x'; known: deepseek_v3, hermes, llama3_json, "
                                         "mistral"):
        tool_parser("x")
