"""Tool-call parsers: the function calls a model writes in its answer text, taken out of the content, incrementally.

A parser is fed the answer text piece by piece (after any reasoning was split off) and returns ``(content, calls)``
for each piece: the text that is plain content, and the calls completed in it. Text that may be the start of a
call is held back until it is known; a call that does not parse stays content, as vLLM does. Three families:

- ``hermes`` (Qwen2.5, Qwen3, QwQ, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number, between or after text;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` to the end of the output;
- ``llama3_json`` (Llama 3.1-3.3): an answer that is a JSON object ``{"name": ..., "parameters": {...}}`` (several
  joined by ``;``), optionally after ``<|python_tag|>``.

Parsers are registered by name (``--tool-call-parser NAME``); without one, ``detect`` reads the chat template. They
run only for requests that give ``tools`` (and ``tool_choice`` other than "none").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from cvllm.server.reasoning import _partial_tag_suffix


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str                  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call(obj: object, arguments_key: str = "arguments") -> ParsedCall | None:
    """A call from a decoded ``{"name": ..., arguments_key: {...}}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):   # some models write the arguments as an already-encoded string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class TaggedParser:
    """Calls between a start and an end tag (``hermes``)."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>"):
        self.start, self.end = start, end
        self.buffer, self.inside = "", False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.inside:
                at = self.buffer.find(self.start)
                if at < 0:
                    keep = _partial_tag_suffix(self.buffer, self.start)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:at])
                self.buffer, self.inside = self.buffer[at + len(self.start):], True
            else:
                at = self.buffer.find(self.end)
                if at < 0:
                    break
                body, self.buffer, self.inside = self.buffer[:at], self.buffer[at + len(self.end):], False
                call = _decode(body)
                if call is None:
                    content.append(self.start + body + self.end)
                else:
                    calls.append(call)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return rest, []
        call = _decode(rest)   # the output ended inside a call (before its end tag): take it if it parses
        return ("", [call]) if call is not None else (self.start + rest, [])


class MistralParser:
    """``[TOOL_CALLS]`` then a JSON array of calls to the end of the output."""

    TAG = "[TOOL_CALLS]"

    def __init__(self):
        self.buffer, self.inside = "", False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        if self.inside:
            return "", []
        at = self.buffer.find(self.TAG)
        if at >= 0:
            content, self.buffer, self.inside = self.buffer[:at], self.buffer[at + len(self.TAG):], True
            return content, []
        keep = _partial_tag_suffix(self.buffer, self.TAG)
        content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return content, []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return rest, []
        try:
            decoded = json.loads(rest)
        except json.JSONDecodeError:
            return self.TAG + rest, []
        calls = [_call(item) for item in (decoded if isinstance(decoded, list) else [decoded])]
        return (self.TAG + rest, []) if None in calls or not calls else ("", calls)


class Llama3JsonParser:
    """An answer that is JSON calls (``{"name": ..., "parameters": {...}}``, ``;``-separated), perhaps after
    ``<|python_tag|>``: held until the output ends, then parsed; anything else is content as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self):
        self.buffer, self.mode = "", None   # None: undecided, "calls", "content"

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        if self.mode == "content":
            return text, []
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self.mode = "calls"
            elif head and not self.TAG.startswith(head):
                self.mode = "content"
                out, self.buffer = self.buffer, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if self.mode != "calls":
            return rest, []
        body = rest.strip().removeprefix(self.TAG)
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return rest, []
            calls.append(call)
        return "", calls


def _decode(body: str) -> ParsedCall | None:
    try:
        return _call(json.loads(body))
    except json.JSONDecodeError:
        return None


ToolParserFactory = Callable[[], object]
_REGISTRY: dict[str, ToolParserFactory] = {"hermes": TaggedParser, "mistral": MistralParser,
                                           "llama3_json": Llama3JsonParser}


def tool_parser(name: str) -> ToolParserFactory:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser '{name}'; known: {', '.join(sorted(_REGISTRY))}") from None


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def detect(template: str | None) -> str | None:
    """The parser a chat template's tool-call format calls for, or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "JSON for a function call" in template:
        return "llama3_json"
    return None
