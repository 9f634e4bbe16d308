"""Reasoning parsers: split a thinking model's ``<think>…</think>`` text from its answer, incrementally.

A parser is fed the output text piece by piece (tags may arrive split over several pieces) and returns
``(reasoning, content)`` for each piece; streaming and non-streaming responses both go through it, so
they agree. Two starting modes:

- plain: the model writes ``<think>`` itself (Qwen3); output that does not start with it is all content;
- opened: the prompt already ends in ``<think>\\n`` (DeepSeek-R1 distills, QwQ), so the output is
  reasoning until ``</think>``.

Parsers are registered by name (``--reasoning-parser NAME``); without one, ``detect`` reads the chat
template.
"""

from __future__ import annotations

from collections.abc import Callable

START, END = "<think>", "</think>"

_BEFORE, _REASONING, _AFTER_END, _CONTENT = range(4)


class ThinkParser:
    def __init__(self, opened: bool):
        self.opened = opened
        self.state = _BEFORE
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = [], []
        while True:
            if self.state == _BEFORE:
                head = self.buffer.lstrip()
                if head.startswith(START):
                    self.buffer = head[len(START):]
                    self.state = _REASONING
                elif START.startswith(head):      # maybe the start of the tag: wait for more text
                    break
                else:
                    self.state = _REASONING if self.opened else _CONTENT
            elif self.state == _REASONING:
                at = self.buffer.find(END)
                if at >= 0:
                    reasoning.append(self.buffer[:at])
                    self.buffer = self.buffer[at + len(END):]
                    self.state = _AFTER_END
                else:
                    keep = partial_tag_suffix(self.buffer, END)
                    reasoning.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
            elif self.state == _AFTER_END:
                # the blank lines between </think> and the answer belong to neither
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    break
                self.state = _CONTENT
            else:
                content.append(self.buffer)
                self.buffer = ""
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: whatever was held back for a possible tag goes where it stands."""
        rest, self.buffer = self.buffer, ""
        if self.state == _REASONING:
            return rest, ""
        if self.state == _BEFORE:
            return (rest, "") if self.opened else ("", rest)
        return "", ("" if self.state == _AFTER_END else rest)


def partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def prompt_opens_reasoning(prompt: str) -> bool:
    return prompt.rstrip().endswith(START)


# A factory gets the rendered prompt (so it can see whether the template opened <think>) and returns a
# fresh parser for one choice.
ParserFactory = Callable[[str], ThinkParser]

_REGISTRY: dict[str, ParserFactory] = {}


def register_reasoning_parser(name: str, factory: ParserFactory) -> None:
    if name in _REGISTRY:
        raise ValueError(f"reasoning parser '{name}' is already registered")
    _REGISTRY[name] = factory


def reasoning_parser(name: str) -> ParserFactory:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser '{name}'; known: {', '.join(sorted(_REGISTRY))}") from None


def reasoning_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def _auto(prompt: str) -> ThinkParser:
    return ThinkParser(opened=prompt_opens_reasoning(prompt))


register_reasoning_parser("think", _auto)              # <think> in the output, or opened by the prompt
register_reasoning_parser("qwen3", _auto)
register_reasoning_parser("deepseek_r1", lambda prompt: ThinkParser(opened=True))


def detect(template: str | None, render: Callable[[], str] | None = None) -> str | None:
    """The parser a chat template calls for: ``deepseek_r1`` when its generation prompt ends in
    ``<think>``, ``think`` when it mentions ``<think>`` or ``</think>`` at all (DeepSeek-R1 distills as first
    released only strip ``</think>`` from history: the model writes ``<think>`` itself), else None."""
    if not template or (START not in template and END not in template):
        return None
    if render is not None:
        try:
            if prompt_opens_reasoning(render()):
                return "deepseek_r1"
        except Exception:  # a template that cannot render a sample conversation still mentions <think>
            pass
    return "think"
