"""The request forms that constrain output, turned into one ``StructuredOutputsParams`` (structured_output/):

- OpenAI's ``response_format``: ``{"type": "json_object"}`` and ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` (llama.cpp's ``{"type": "json_object", "schema": {...}}`` too);
- vLLM's ``structured_outputs`` ``{json, regex, choice, grammar, json_object}`` and its older ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``;
- llama.cpp's ``json_schema`` and ``grammar`` (GBNF, or Lark as llguidance reads it);
- ``tool_choice`` "required" or a named function: the calls as JSON that always parses (vLLM's forms: an array of
  ``{"name", "parameters"}`` objects, or the named function's arguments object).

A request gives at most one; a schema, regex or grammar that does not compile is a 400 naming the field.
On a thinking model the grammar applies to the answer after the reasoning (structured_output.reasoning_bounds).
"""

from __future__ import annotations

from typing import Any

from cvllm.sampling_params import SamplingParamError
from cvllm.server.errors import bad_request
from cvllm.structured_output import StructuredOutputsParams

FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def requested_structure(request) -> StructuredOutputsParams | None:
    """The request's output constraint (a chat or completion request), or None."""
    forms: list[tuple[str, dict[str, Any]]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None and response_format.type != "text":
        forms.append(("response_format", _response_format(response_format)))
    if request.structured_outputs is not None:
        unknown = sorted(set(request.structured_outputs) - set(FIELDS))
        if unknown:
            raise bad_request(f"structured_outputs takes {', '.join(FIELDS)}; unknown: {', '.join(unknown)}",
                              param="structured_outputs")
        forms.append(("structured_outputs", dict(request.structured_outputs)))
    for name, field in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            forms.append((name, {field: value}))
    tools_form = _tool_choice_form(request)
    if tools_form is not None:
        forms.append(("tool_choice", tools_form))
    if not forms:
        return None
    if len(forms) > 1:
        raise bad_request(f"Give one way of constraining the output; this request gives {len(forms)}: "
                          f"{', '.join(name for name, _ in forms)}", param=forms[1][0])
    param, fields = forms[0]
    try:
        return StructuredOutputsParams(**fields)
    except SamplingParamError as e:
        raise bad_request(f"{param}: {e}", param=param) from None
    except TypeError as e:
        raise bad_request(f"{param}: {e}", param=param) from None


def _response_format(response_format) -> dict[str, Any]:
    if response_format.type == "json_object":
        schema = response_format.schema   # llama.cpp's extension
        return {"json": schema} if schema is not None else {"json_object": True}
    spec = response_format.json_schema
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema needs a json_schema object ({\"name\": ..., \"schema\": "
                          "{...}})", param="response_format")
    schema = spec.get("schema")
    if schema is None:   # OpenAI allows leaving it out: any JSON object
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object", param="response_format")
    return {"json": schema}


def _tool_choice_form(request) -> dict[str, Any] | None:
    """The grammar that forces ``tool_choice`` "required" or a named function (None for none/auto)."""
    choice = getattr(request, "tool_choice", None)
    if choice is None or choice in ("none", "auto"):
        return None
    tools = getattr(request, "tools", None) or []
    if not tools:
        raise bad_request(f"tool_choice {_describe(choice)} needs tools", param="tool_choice")
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "const": tool.function.name},
                                                   "parameters": _parameters(tool)},
                  "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return {"json": schema}
    named = next((tool for tool in tools if tool.function.name == choice.function.name), None)
    if named is None:
        raise bad_request(f"tool_choice names the function {choice.function.name!r}, which tools do not define; "
                          f"defined: {', '.join(tool.function.name for tool in tools)}", param="tool_choice")
    return {"json": _parameters(named)}


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def _describe(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"
