"""Rendering chat templates the way transformers does (sandboxed jinja2)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template raised or could not be compiled; the message is the template's own."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


def flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Multi-part text content ([{"type": "text", "text": ...}, ...]) → one string, as most templates expect."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            message = {**message, "content": "".join(p.get("text", "") for p in content)}
        out.append(message)
    return out


def render_chat(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                special_tokens: dict[str, str | None] | None = None, tools: list | None = None,
                **template_kwargs: Any) -> str:
    template = compile_template(source)
    try:
        return template.render(messages=flatten_content(messages), add_generation_prompt=add_generation_prompt,
                               tools=tools, **(special_tokens or {}), **template_kwargs)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
