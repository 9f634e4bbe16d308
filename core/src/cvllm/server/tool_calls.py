"""Tool-call parsers: the function calls a model writes in its answer text, taken out of the content, incrementally.

A parser is fed the answer text piece by piece (after any reasoning was split off) and returns ``(content, calls)``
for each piece: the text that is plain content, and the calls completed in it. Text that may be the start of a
call is held back until it is known; a call that does not parse stays content, as vLLM does. Three families:

- ``hermes`` (Qwen2.5, Qwen3, QwQ, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any
  number, between or after text;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` to the end of the output;
- ``llama3_json`` (Llama 3.1-3.3): an answer that is a JSON object ``{"name": ..., "parameters": {...}}`` (several
  joined by ``;``), optionally after ``<|python_tag|>``;
- ``deepseek_v3`` (DeepSeek V3, R1 and its distills): the calls between DeepSeek's tool-call tokens.

Parsers are registered by name through the ``register_tool_parsers`` hook (core registers these; a plugin adds
its own) and chosen by ``--tool-call-parser NAME`` or, without one, by ``detect`` from the chat template. They run
only for requests that give ``tools`` (and ``tool_choice`` other than "none").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from cvllm.server.reasoning import partial_tag_suffix


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str                  # a JSON object, as text
    id: str = field(default_factory=new_call_id)


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
                    keep = partial_tag_suffix(self.buffer, self.start)
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
                found = self.decode(body)
                if found is None:
                    content.append(self.start + body + self.end)
                else:
                    calls += found
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return rest, []
        found = self.decode(rest)   # the output ended inside the tags (before the end tag): take it if it parses
        return ("", found) if found is not None else (self.start + rest, [])

    def decode(self, body: str) -> list[ParsedCall] | None:
        """The calls between one start and end tag, or None: it stays text."""
        call = _decode(body)
        return None if call is None else [call]


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
        keep = partial_tag_suffix(self.buffer, self.TAG)
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


class DeepSeekParser(TaggedParser):
    """DeepSeek V3 / R1: ``<｜tool▁calls▁begin｜>`` then calls ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``,
    a newline, the arguments in a ```json fence, ``<｜tool▁call▁end｜>``; then ``<｜tool▁calls▁end｜>``."""

    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"

    def __init__(self):
        super().__init__(self.BEGIN, self.END)

    def decode(self, body: str) -> list[ParsedCall] | None:
        calls = [self._call(part.split(self.CALL_END)[0]) for part in body.split(self.CALL_BEGIN)[1:]]
        return None if not calls or None in calls else calls

    def _call(self, body: str) -> ParsedCall | None:
        head, newline, arguments = body.partition("\n")
        _, sep, name = head.partition(self.SEP)
        if not newline or not sep:
            return None
        arguments = arguments.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        try:
            return _call({"name": name.strip(), "arguments": json.loads(arguments)})
        except json.JSONDecodeError:
            return None


class ForcedCallsParser:
    """The output of ``tool_choice`` "required" (``name`` None: a JSON array of ``{"name", "parameters"}``) or of
    a named function (its arguments object), which a grammar forced (server/structured.py): all of it is calls,
    parsed when it ends. Output cut short (max_tokens) does not parse and stays content. A named function's
    arguments also stream as they come (``fragments``): the call is known from the first token."""

    def __init__(self, name: str | None):
        self.name, self.buffer = name, ""
        self.call_id = new_call_id() if name is not None else None

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        return "", []

    def fragments(self, text: str, first: bool) -> list[tuple[str | None, str | None, str]]:
        """Streaming a named call: (id, name, arguments text) deltas for ``text``, the id and name on the first."""
        if self.name is None or not (text or first):
            return []
        return [(self.call_id, self.name, text) if first else (None, None, text)]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        rest, self.buffer = self.buffer, ""
        try:
            value = json.loads(rest)
        except json.JSONDecodeError:
            return rest, []
        if self.name is not None:
            calls = [_call({"name": self.name, "arguments": value})]
            if calls[0] is not None:
                calls[0].id = self.call_id
        else:
            calls = [_call(item, "parameters") for item in value] if isinstance(value, list) else [None]
        return (rest, []) if not calls or None in calls else ("", calls)


def tool_parser(name: str) -> Callable[[], object]:
    """The factory registered as ``name`` (core's, or a plugin's through ``register_tool_parsers``)."""
    from cvllm import plugins

    registry = plugins.tool_parsers()
    if name not in registry:
        raise ValueError(f"unknown tool-call parser '{name}'; known: {', '.join(registry.names())}")
    return registry.get(name)


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
    if DeepSeekParser.BEGIN in template:
        return "deepseek_v3"
    return None
