"""Rendering chat templates exactly as transformers' ``apply_chat_template(tokenize=False)`` does.

What a template sees is what transformers gives it: a sandboxed, immutable jinja2 environment with
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block tag;
``tojson`` as ``json.dumps`` without ASCII escaping; ``raise_exception``, ``strftime_now`` and
underscore-proof ``namespace``/``dict``; the variables ``messages``, ``tools``, ``documents``,
``add_generation_prompt``, the tokenizer's special tokens and any extra template kwargs. The messages are
cleaned the same way too: keys whose value is None dropped, reasoning copied under its three names, and
``continue_final_message`` done by rendering a marker after the final message and cutting there.

One step comes first, from the API rather than from transformers (see ``flatten_content``): null content becomes
"", and multi-part content (text parts only) becomes one string, the texts joined with "\n", unless the template
loops over a message's content (``wants_content_parts``: vLLM's "openai" content format, e.g. Gemma 3's), which then
gets the list of parts as transformers would pass it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace


class ChatTemplateError(ValueError):
    """The chat could not be rendered: the template raised, does not compile, or the input does not fit it.

    The message is the template's own for ``raise_exception``; the server answers these with a 400.
    """


# The names a message's reasoning travels under; templates read the first, gpt-oss ones read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message when continuing it, so the rendered text can be cut right after it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# --- the jinja environment ------------------------------------------------------------------------

def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(Namespace):
    """``namespace()`` that refuses underscore names, so a template cannot reach CPython internals through it."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


class _DictBuilder:
    """``dict(...)`` and ``dict.fromkeys(...)`` for templates, without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                         extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = _environment()
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictBuilder()
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


# --- preparing what the template sees -------------------------------------------------------------

@lru_cache(maxsize=32)
def wants_content_parts(source: str) -> bool:
    """Whether the template loops over a message's content (``{% for part in message['content'] %}``, directly or
    through a variable set from it): it then renders multi-part content itself, and gets the parts."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return False   # compile_template reports it
    names = {assign.target.name for assign in tree.find_all(nodes.Assign)
             if isinstance(assign.target, nodes.Name) and _is_content(assign.node, set())}
    return any(_is_content(loop.iter, names) for loop in tree.find_all(nodes.For))


def _is_content(node: nodes.Node, names: set[str]) -> bool:
    """``x.content``, ``x['content']`` or a variable set from one, through any filters."""
    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Name) and node.name in names


def flatten_content(messages: list[dict[str, Any]], keep_parts: bool = False) -> list[dict[str, Any]]:
    """Every message's content as one string, the form templates expect (the API's rule, as vLLM does it), or with
    ``keep_parts`` (a template that loops over content parts) multi-part content as its list of text parts.

    Multi-part content ``[{"type": "text", "text": ...}, ...]`` becomes the texts joined with "\\n"; any
    other part type is refused, naming it. A null or missing content becomes "" (vLLM does the same;
    transformers would drop the key, which Qwen3's and QwQ's templates cannot render for tool-call turns).
    Messages are copied, never changed in place.
    """
    out = []
    for message in messages:
        if isinstance(message, Mapping):
            content = message.get("content")
            if content is None:
                message = {**message, "content": ""}
            elif isinstance(content, list):
                texts = [_part_text(part) for part in content]
                parts = [{"type": "text", "text": text} for text in texts]
                message = {**message, "content": parts if keep_parts else "\n".join(texts)}
        out.append(message)
    return out


def _part_text(part: Any) -> str:
    part_type = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    if part_type != "text":
        raise ChatTemplateError(f"content part type {part_type!r} is not supported; only 'text' parts are")
    return str(part.get("text") or "")


def _plain(value: Any) -> Any:
    """A fresh copy made of plain JSON-like types only: what transformers lets a template touch."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums...) could carry methods the sandbox does not know
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"  # an inert placeholder, as transformers renders unknown objects


def _prepare_messages(messages: list[Any], keep_parts: bool = False) -> list[dict[str, Any]]:
    if not messages:
        raise ChatTemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    chat = []
    for message in flatten_content(messages, keep_parts):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"Chat messages should be dicts, but got {message!r}.")
        # Clients send content=null or tool_calls=null; templates handle a missing key but not a None one.
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # same key order as transformers: "thinking" first unless already present
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def _tag_final_message(chat: list[dict[str, Any]], source: str, field: str) -> str:
    """Append the continue tag to the final message's ``field`` (and its aliases); return the text continued."""
    final = chat[-1].get(field)
    if final is None:
        raise ChatTemplateError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag each copy
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise ChatTemplateError(
            f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                return final
        raise ChatTemplateError(
            "continue_final_message is set but we could not find any text to continue in the final message!")
    if not isinstance(final, str):
        raise ChatTemplateError(f'continue_final_message is set but the final message\'s "{field}" is not text')
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_after_final_message(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError(
            "continue_final_message is set but the final message does not appear in the chat after applying the "
            "chat template! This can happen if the chat template deletes portions of the final message. "
            f"Final message to continue: {final.strip()}")
    at = rendered.rindex(tag)
    if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the tag's trailing space, so trailing spacing is unsure


# --- rendering ------------------------------------------------------------------------------------

def render_chat(source: str, messages: list[dict[str, Any]], /, *, add_generation_prompt: bool = True,
                continue_final_message: bool | str = False, special_tokens: dict[str, str | None] | None = None,
                tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
    """Render ``messages`` with the template ``source`` as transformers' ``apply_chat_template`` would.

    ``special_tokens`` maps names like ``bos_token`` to their text (None values are left out, as transformers
    leaves out unset tokens); ``template_kwargs`` (e.g. ``enable_thinking``, ``documents``, ``date_string``)
    become template variables and override special tokens of the same name. ``continue_final_message``
    (True, or the name of the field to continue) leaves the final message open; like transformers it cannot
    be combined with ``add_generation_prompt``. Raises ChatTemplateError for anything the input or the
    template gets wrong.
    """
    if "messages" in template_kwargs:
        raise ChatTemplateError("'messages' cannot be passed as a chat template kwarg")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message when "
            "you want the model to continue the final message, and add_generation_prompt when you want to add a "
            "header that will prompt it to start a new assistant message instead.")
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise ChatTemplateError("Tools should be JSON schemas (dicts).")
    documents = template_kwargs.get("documents")
    if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
        raise ChatTemplateError("Documents should be a list of dicts with 'title' and 'text' keys!")
    template = compile_template(source)
    chat = _prepare_messages(messages, wants_content_parts(source))
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, source, field)
    variables = {name: text for name, text in (special_tokens or {}).items() if text is not None}
    variables.update(template_kwargs)
    variables.setdefault("documents", None)
    try:
        rendered = template.render(messages=chat, tools=_plain(tools), add_generation_prompt=add_generation_prompt,
                                   **_plain(variables))
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except Exception as e:  # a template doing arithmetic on the wrong types: still the input's fault, not ours
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    if final is not None:
        rendered = _cut_after_final_message(rendered, final)
    return rendered
