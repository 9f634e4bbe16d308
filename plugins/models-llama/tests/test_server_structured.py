"""Structured output and forced tool calls through a real cvserve on a tiny random Llama, driven by the openai SDK:
every request form, ``chat.completions.parse()`` with a pydantic model, streamed tool calls, and the 400s."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import openai
import pytest

from cvllm.testing import make_checkpoint
from cvllm.testing.server import LiveServer

pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the dragon."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "level"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "level": {"type": "integer", "minimum": 1, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 12}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
              "type": "object", "additionalProperties": False, "required": ["zone"],
              "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}]


class Dragon(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=10)]
    colour: Literal["red", "green", "gold"]
    heads: Annotated[int, pydantic.Field(ge=1, le=3)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("server-structured")
    make_checkpoint(path, "llama", seed=5)
    engine = {"model": str(path), "dtype": "float32", "backend": "cpu", "max_num_seqs": 8}
    with LiveServer(engine, served_model_names=[MODEL]) as live:
        yield live


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=1.0,
                                          seed=1, **kw).choices[0]


@pytest.mark.parametrize("form", ["response_format", "structured_outputs", "guided_json", "json_schema"])
def test_every_json_schema_form(client, form):
    value = {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA,
                                                                        "strict": True}},
             "structured_outputs": {"json": SCHEMA}, "guided_json": SCHEMA, "json_schema": SCHEMA}[form]
    choice = chat(client, extra_body={form: value})
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


@pytest.mark.parametrize("body, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_regex": "[a-z]{2,5}-[0-9]{2}"}, lambda t: re.fullmatch("[a-z]{2,5}-[0-9]{2}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"guided_grammar": 'root ::= "A" | "B" [0-9]'}, lambda t: re.fullmatch("A|B[0-9]", t)),
    ({"grammar": 'start: "x" "y"+\n'}, lambda t: re.fullmatch("xy+", t)),
])
def test_regex_choice_and_grammar_forms(client, body, check):
    for seed in range(3):
        choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0,
                                                seed=seed, extra_body=body).choices[0]
        if choice.finish_reason == "length" and "response_format" in body:
            continue   # any JSON object: a random model may still be writing it
        assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content


def test_completions_take_the_forms_too(client):
    out = client.completions.create(model=MODEL, prompt="The dragon", max_tokens=40, temperature=1.0,
                                    extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_the_sdks_parse_fills_a_pydantic_model(client):
    for seed in range(3):
        parsed = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Dragon,
                                               max_tokens=120, seed=seed).choices[0].message.parsed
        assert isinstance(parsed, Dragon)


def test_tool_choice_required_gives_calls_that_parse(client):
    for seed in range(3):
        choice = chat(client, tools=TOOLS, tool_choice="required", extra_body={"seed": seed})
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_named_tool_choice_calls_that_function(client):
    choice = chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_forced_tool_calls_stream_in_the_openai_delta_shape(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, seed=2, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or delta.id
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]   # parallel_tool_calls false: one call
    assert calls[0]["id"] and calls[0]["name"] in ("get_weather", "get_time")
    json.loads(calls[0]["arguments"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_constraints_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert error.value.body["param"] == param, error.value.body


def test_a_named_calls_arguments_stream_as_fragments(client):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=120, seed=3,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            stream=True)
    deltas, finish = [], None
    for chunk in stream:
        deltas += chunk.choices[0].delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    first, *rest = deltas
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "get_weather"
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])
    assert finish == "tool_calls"
