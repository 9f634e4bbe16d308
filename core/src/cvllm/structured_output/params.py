"""What a request constrains its output to: vLLM's ``StructuredOutputsParams`` (json, regex, choice, grammar,
json_object), checked where it is built, so a bad schema is the caller's error (a 400 naming it), never the engine's.

Each form becomes one llguidance grammar (its JSON-schema, regex and Lark front ends; GBNF, llama.cpp's grammar
format, is converted to Lark). JSON is written as Python's ``json.dumps`` writes it (", " and ": ", no other
whitespace): a model cannot pad an object with blank lines until max_tokens, as it can where any whitespace is
allowed. A schema's own ``x-guidance`` options (llguidance's) override that.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import msgspec

FORMS = ("json", "regex", "choice", "grammar", "json_object")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    json: str | dict[str, Any] | None = None      # a JSON schema, as an object or its text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None                     # Lark (llguidance's dialect) or GBNF (llama.cpp's)
    json_object: bool | None = None                # any JSON object
    # A thinking model's reasoning is free text: the chat front ends (server, LLM.chat) set these so the grammar
    # applies to the answer only. reasoning_end: the token ids of "</think>"; the grammar starts once the output
    # has them. reasoning_start: "<think>"'s id, where the model may open its thinking itself (Qwen3): the first
    # output token may then be it (and the grammar waits for reasoning_end) or the grammar's first token.
    reasoning_end: list[int] | None = None
    reasoning_start: int | None = None

    def __post_init__(self) -> None:
        from cvllm.sampling_params import SamplingParamError  # (sampling_params imports this module)

        given = [form for form in FORMS if getattr(self, form) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamError("structured_outputs", "structured_outputs takes exactly one of "
                                     f"{', '.join(FORMS)}; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise SamplingParamError("structured_outputs", "structured_outputs.choice must be a non-empty list of "
                                                           "strings")
        if self.reasoning_end is not None and not self.reasoning_end:
            raise SamplingParamError("structured_outputs", "structured_outputs.reasoning_end must not be empty")
        grammar_text(self)   # compiles (cached) and raises on a bad schema, regex or grammar

    @property
    def form(self) -> str:
        return next(form for form in FORMS if getattr(self, form) not in (None, False))

    def describe(self) -> str:
        """For errors and logs: the form and the start of its text."""
        value = getattr(self, self.form)
        text = value if isinstance(value, str) else json.dumps(value)
        return f"{self.form} {text[:60]!r}{'...' if len(text) > 60 else ''}"


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (validated; the same text for the same request body, cached)."""
    form = params.form
    value = getattr(params, form)
    if form == "json" and isinstance(value, dict):
        value = json.dumps(value)   # (key order kept: properties come out in the order the schema gives)
    elif form == "choice":
        value = json.dumps(value)
    elif form == "json_object":
        form, value = "json", '{"type": "object"}'
    return _compile(form, value)


@functools.lru_cache(maxsize=256)
def _compile(form: str, text: str) -> str:
    from llguidance import LLMatcher, grammar_from

    from cvllm.sampling_params import SamplingParamError

    what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[form]
    try:
        if form == "json":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        else:
            grammar = grammar_from(form, text)
    except ValueError as e:   # json.JSONDecodeError is one
        raise SamplingParamError("structured_outputs", f"invalid {what}: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise SamplingParamError("structured_outputs", f"invalid {what}: {messages[0].strip()}")
    return grammar


def reasoning_bounds(params: StructuredOutputsParams, prompt: str, opened: bool, tokenizer
                     ) -> StructuredOutputsParams:
    """``params`` for a thinking model's chat: the grammar starts after ``</think>``. ``opened``: the reasoning
    parser's mode (the prompt opened the thinking, or the model is expected to). Unchanged where the prompt closed
    the thinking already (``enable_thinking: false``) or the tags are not in the vocabulary."""
    from cvllm.server.reasoning import END, START  # (plain Python: no server dependency)

    if prompt.rstrip().endswith(END):
        return params
    end = tokenizer.encode(END, add_special_tokens=False)
    start = tokenizer.encode(START, add_special_tokens=False)
    if not end or tokenizer.decode(end, skip_special_tokens=False) != END:
        return params
    if opened or prompt.rstrip().endswith(START):
        return msgspec.structs.replace(params, reasoning_end=end)
    if len(start) != 1:   # the model could open its thinking only over several tokens: the grammar from the start
        return params
    return msgspec.structs.replace(params, reasoning_end=end, reasoning_start=start[0])
